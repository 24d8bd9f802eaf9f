"""Shared test helpers: tiny random MiniCPM4 checkpoints, a NumPy reference forward, HF oracles."""

from __future__ import annotations

import json
import math
import os

import numpy as np
from safetensors.numpy import save_file


def tiny_minicpm_config(**overrides) -> dict:
    """A small MiniCPM4-style config.json: GQA 4:1, untied head, non-trivial scalings and LongRoPE."""
    head_dim = 16
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


# ----------------------------------------------------------------------------- NumPy reference
def numpy_forward(cfg: dict, w: dict[str, np.ndarray], ids: np.ndarray, max_length: int) -> np.ndarray:
    """Logits ``[T, vocab]`` (float64) of one sequence, written directly from the MiniCPM4 formulas."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    eps = cfg["rms_norm_eps"]
    t = len(ids)
    W = {k: v.astype(np.float64) for k, v in w.items()}

    # RoPE: inv_freq_i = 1 / (ext_i * theta^(2i/d)); ext = long iff the cache exceeds the original length.
    rs = cfg.get("rope_scaling") or {}
    inv = 1.0 / cfg.get("rope_theta", 10000.0) ** (np.arange(0, d, 2) / d)
    mscale = 1.0
    if rs.get("rope_type") == "longrope":
        orig = rs["original_max_position_embeddings"]
        ext = np.array(rs["long_factor"] if max_length > orig else rs["short_factor"])
        inv = inv / ext
        ratio = cfg["max_position_embeddings"] / orig
        mscale = math.sqrt(1 + math.log(ratio) / math.log(orig)) if ratio > 1 else 1.0
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1) * mscale
    sin = np.concatenate([np.sin(ang)] * 2, -1) * mscale

    def rope(x):  # [T, heads, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        rot = np.concatenate([-x2, x1], -1)
        return x * cos[:, None] + rot * sin[:, None]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1 + np.exp(-x))

    res = cfg.get("scale_depth", 1.0) / math.sqrt(L) if cfg["model_type"] == "minicpm" else 1.0
    x = W["model.embed_tokens.weight"][ids] * (cfg.get("scale_emb", 1.0) if cfg["model_type"] == "minicpm" else 1.0)
    causal = np.tril(np.ones((t, t), bool))
    for layer in range(L):
        p = f"model.layers.{layer}."
        a = rms(x, W[p + "input_layernorm.weight"])
        q = rope((a @ W[p + "self_attn.q_proj.weight"].T).reshape(t, nh, d))
        k = rope((a @ W[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, d))
        v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, d)
        out = np.zeros((t, nh, d))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[:, head] @ k[:, kv].T / math.sqrt(d)
            s = np.where(causal, s, -np.inf)
            p_ = np.exp(s - s.max(-1, keepdims=True))
            p_ /= p_.sum(-1, keepdims=True)
            out[:, head] = p_ @ v[:, kv]
        x = x + res * (out.reshape(t, nh * d) @ W[p + "self_attn.o_proj.weight"].T)
        m = rms(x, W[p + "post_attention_layernorm.weight"])
        g = silu(m @ W[p + "mlp.gate_proj.weight"].T) * (m @ W[p + "mlp.up_proj.weight"].T)
        x = x + res * (g @ W[p + "mlp.down_proj.weight"].T)
    x = rms(x, W["model.norm.weight"])
    if cfg["model_type"] == "minicpm":
        x = x / (h / cfg.get("dim_model_base", 1.0))
    head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else W["lm_head.weight"]
    return x @ head.T


# ----------------------------------------------------------------------------- transformers oracle
def hf_llama_with_minicpm_folded(cfg: dict, w: dict[str, np.ndarray]):
    """transformers ``LlamaForCausalLM`` computing the same function as a MiniCPM checkpoint.

    scale_emb is folded into the embedding, scale_depth/sqrt(L) into o_proj and down_proj, and
    dim_model_base/hidden into lm_head; LongRoPE goes through transformers' own rope init.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    L = cfg["num_hidden_layers"]
    rs = cfg.get("rope_scaling")
    rope_parameters = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if rs and rs.get("rope_type") == "longrope":
        rope_parameters = {
            "rope_type": "longrope",
            "rope_theta": cfg["rope_theta"],
            "short_factor": rs["short_factor"],
            "long_factor": rs["long_factor"],
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
        }
    lcfg = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=L,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(lcfg).eval()
    res = cfg["scale_depth"] / math.sqrt(L)
    sd = {}
    for name, value in w.items():
        v = value.astype(np.float32)
        if name == "model.embed_tokens.weight":
            v = v * cfg["scale_emb"]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            v = v * res
        sd[name] = torch.from_numpy(np.ascontiguousarray(v))
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    sd["lm_head.weight"] = torch.from_numpy(np.ascontiguousarray(head * (cfg["dim_model_base"] / cfg["hidden_size"])))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


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
