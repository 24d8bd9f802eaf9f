"""Test data builders: tiny random MiniCPM4 configs and checkpoints, the small InfLLM-v2 geometry, random
trees, int4 weights and GPTQ tensors, cache-writer inputs, an abstract GPU mesh, error measures, and a live
server process on a free port.

The oracles (NumPy forward, transformers, format definitions) are in :mod:`tests.oracles`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from safetensors.numpy import save_file

from minicpm_jax.config import SparseConfig
from minicpm_jax.io import int4_formats
from tests.oracles import pack_cols_oracle, pack_rows_oracle

# MiniCPM4's InfLLM-v2 geometry scaled down 8x: windows 4/2 and 16/8, 8-token blocks, 2 local blocks + 1 init.
SMALL = SparseConfig(kernel_size=4, kernel_stride=2, init_blocks=1, block_size=8, window_size=16, topk=3,
                     use_nope=False, dense_len=32)


def tiny_minicpm_config(**overrides) -> dict:
    """A small MiniCPM4-style config.json: GQA 4:1, untied head, non-trivial scalings and LongRoPE (its
    factors sized for the ``head_dim`` override, 16 by default)."""
    head_dim = overrides.get("head_dim", 16)
    rng = np.random.default_rng(123)
    cfg = {
        "architectures": ["MiniCPMForCausalLM"],
        "model_type": "minicpm",
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [float(x) for x in 1.0 + rng.random(head_dim // 2)],
            "long_factor": [float(x) for x in 2.0 + 3.0 * rng.random(head_dim // 2)],
            "original_max_position_embeddings": 64,
        },
        "scale_emb": 12.0,
        "scale_depth": 1.4,
        "dim_model_base": 16,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": [2, 5],
        "sparse_config": {"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64,
                          "window_size": 2048, "topk": 64, "use_nope": False, "dense_len": 8192},
    }
    cfg.update(overrides)
    return cfg


def random_hf_weights(cfg: dict, seed: int = 0, std: float = 0.08) -> dict[str, np.ndarray]:
    """Random float32 tensors under Hugging Face names (``[out, in]`` matrices)."""
    rng = np.random.default_rng(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def mat(*shape):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(cfg["vocab_size"], h), "model.norm.weight": norm()}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w.update({
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": mat(nq, h),
            p + "self_attn.k_proj.weight": mat(nkv, h),
            p + "self_attn.v_proj.weight": mat(nkv, h),
            p + "self_attn.o_proj.weight": mat(h, nq),
            p + "mlp.gate_proj.weight": mat(i, h),
            p + "mlp.up_proj.weight": mat(i, h),
            p + "mlp.down_proj.weight": mat(h, i),
        })
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(cfg["vocab_size"], h)
    return w


def write_checkpoint(path: str, cfg: dict, weights: dict[str, np.ndarray], shards: int = 1) -> str:
    """Writes config.json + safetensors (sharded with an index when shards > 1); returns path."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(weights)
    if shards == 1:
        save_file(weights, os.path.join(path, "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cache_write_inputs(seed: int, layers: int, b: int, h: int, s: int, d: int, t: int):
    """Random K/V caches ``[layers, b, h, s, d]`` and new tokens ``[b, t, h, d]`` (float32 NumPy) for the
    cache writer, with slots ``int32 [b, t]``: every row's slots distinct (a decode step or a tree never
    writes one slot twice), and some out of range, so dropped: the last row's first token at ``s`` (a
    finished row) and, with 2+ tokens, row 0's last at -1 and the last row's last past ``s``."""
    rng = np.random.default_rng(seed)
    kc, vc = (rng.standard_normal((layers, b, h, s, d)) for _ in range(2))
    kn, vn = (rng.standard_normal((b, t, h, d)) for _ in range(2))
    slots = np.stack([rng.permutation(s)[:t] for _ in range(b)]).astype(np.int32)
    slots[-1, 0] = s
    if t > 1:
        slots[0, -1], slots[-1, -1] = -1, s + 2
    return kc, vc, kn, vn, slots


def random_tree(rng, t: int, max_depth: int):
    """depths and the ancestor-or-self mask ``bool[t, t]`` of a random tree of ``t`` nodes (node 0 = the
    root, parent < child, depth at most ``max_depth``)."""
    parent = np.zeros(t, np.int64)
    depth = np.zeros(t, np.int64)
    for i in range(1, t):
        choices = [j for j in range(i) if depth[j] < max_depth]
        parent[i] = rng.choice(choices)
        depth[i] = depth[parent[i]] + 1
    mask = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while True:
            mask[i, j] = True
            if j == 0:
                break
            j = parent[j]
    return depth, mask


def abstract_gpu_mesh():
    """A one-device abstract mesh of an H100, to lower kernels for CUDA without a GPU; skips the calling
    test on a jax that cannot trace for an abstract GPU."""
    import pytest

    try:
        from jax.sharding import AbstractDevice, AbstractMesh

        device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
        return AbstractMesh((1,), ("x",), abstract_device=device)
    except (ImportError, TypeError) as e:  # pragma: no cover - older jax
        pytest.skip(f"this jax cannot trace for an abstract GPU: {e}")


# ----------------------------------------------------------------------------- int4 weights
def act_order_g_idx(rng, k: int, gs: int) -> np.ndarray:
    """Each of the k/gs groups exactly gs rows, scattered over K (GPTQ desc_act without static groups)."""
    return rng.permutation(np.repeat(np.arange(k // gs), gs)).astype(np.int32)


def random_weight(rng, k, n, gs, *, sym=True, act_order=False) -> int4_formats.Int4Weight:
    g_idx = act_order_g_idx(rng, k, gs) if act_order else np.arange(k, dtype=np.int32) // gs
    scales = rng.uniform(0.005, 0.02, (k // gs, n)).astype(np.float32)
    zeros = None if sym else rng.integers(0, 16, (k // gs, n)).astype(np.float32)
    return int4_formats.Int4Weight(rng.integers(0, 16, (k, n)).astype(np.uint8), scales, zeros, g_idx, gs)


def random_gptq_tensors(rng, k, n, gs, *, sym, fmt, act_order):
    """(codes, qweight, qzeros, scales, g_idx) of a random GPTQ linear, packed by the format oracles;
    symmetric zeros stored as 7 (v1) or 8 (v2)."""
    groups = 1 if gs == -1 else k // gs
    real_gs = k if gs == -1 else gs
    q = rng.integers(0, 16, (k, n))
    if sym:
        stored = np.full((groups, n), 7 if fmt == "gptq" else 8)
    else:
        stored = rng.integers(0, 16, (groups, n))
    qweight, qzeros = pack_rows_oracle(q), pack_cols_oracle(stored)
    scales = rng.uniform(0.001, 0.05, (groups, n)).astype(np.float16)
    g_idx = act_order_g_idx(rng, k, real_gs) if act_order else np.arange(k, dtype=np.int32) // real_gs
    return q, qweight, qzeros, scales, g_idx


def assert_close(got, want, rtol):
    """Elementwise, relative to the output's scale."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x output scale {scale:.3g}"


# ----------------------------------------------------------------------------- a live server process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m minicpm_jax.server`` with ``flags`` on a free port, its output in a log file; ready
    once ``/health`` answers (RuntimeError if it exits or does not start)."""

    def __init__(self, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.environ.get("MINICPM_JAX_CACHE", "/tmp"), f"server-{self.port}.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "minicpm_jax.server", "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=os.environ)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError(f"server did not start: {self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
