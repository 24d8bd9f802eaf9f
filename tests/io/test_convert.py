"""Converters: GGUF → HF → native round trips, inspect, atomic writes and bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import jax.numpy as jnp
import pytest

from checkpoints_convert.common import atomic_output_dir
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.native import is_native
from minicpm_jax.model.loading import load_model
from tests import helpers


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "checkpoints_convert", *args], capture_output=True, text=True, **kw)


def _logits(path, ids):
    model = load_model(path, dtype=jnp.float32, max_length=64)
    logits, _, _ = model(jnp.asarray([ids], jnp.int32), model.new_cache(1, 64))
    return np.asarray(logits[0])


@pytest.mark.smollm2
def test_gguf_to_hf_to_native_round_trip(smollm2_dir, tmp_path):
    native = str(tmp_path / "native")
    r = _cli("hf", "--src", smollm2_dir, "--dst", native)
    assert r.returncode == 0, r.stderr
    assert is_native(native) and os.path.isfile(os.path.join(native, "tokenizer.json"))
    ids = list(range(5, 40))
    assert helpers.rel_err(_logits(native, ids), _logits(smollm2_dir, ids)) < 1e-6
    # inspect reads both formats without loading the weights.
    out = _cli("inspect", native, "--no_tensors").stdout
    assert "format:        native" in out and "parameters:    134,515,008" in out and "tied head: True" in out
    info = json.loads(_cli("inspect", smollm2_dir, "--json").stdout)
    assert info["format"] == "hf-safetensors" and info["parameters"] == 134_515_008
    assert info["tensors"]["model.layers.0.self_attn.k_proj.weight"] == {"shape": [192, 576], "dtype": "float32"}


@pytest.mark.smollm2
def test_inspect_gguf(smollm2_gguf):
    out = _cli("inspect", smollm2_gguf).stdout
    assert "format:        gguf" in out and "layers:        30" in out
    assert "blk.0.attn_q.weight" in out and "Q4_1" in out


def test_native_round_trip_of_minicpm4_and_dtype(tiny_ckpt, tmp_path):
    from checkpoints_convert.hf import convert_hf

    src, cfg, _ = tiny_ckpt
    dst = str(tmp_path / "native")
    convert_hf(src, dst)
    ids = [3, 9, 27, 81, 4, 12]
    assert helpers.rel_err(_logits(dst, ids), _logits(src, ids)) < 1e-6
    with open(os.path.join(dst, "config.json")) as f:
        native_cfg = json.load(f)
    assert native_cfg["minicpm_jax"]["dtype"] == "float32" and native_cfg["scale_emb"] == cfg["scale_emb"]
    assert native_cfg["sparse_config"] == cfg["sparse_config"]
    half = str(tmp_path / "native_bf16")
    convert_hf(src, half, dtype="bfloat16")
    assert helpers.rel_err(_logits(half, ids), _logits(src, ids)) < 3e-2


def test_existing_destination_needs_overwrite(tiny_ckpt, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = _cli("hf", "--src", tiny_ckpt[0], "--dst", str(dst))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: destination {dst} already exists; pass --overwrite to replace it"
    assert (dst / "keep.txt").read_text() == "mine"
    assert _cli("hf", "--src", tiny_ckpt[0], "--dst", str(dst), "--overwrite").returncode == 0
    assert is_native(str(dst)) and not (dst / "keep.txt").exists()


def test_interrupted_write_leaves_nothing(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(str(dst)) as tmp:
            open(os.path.join(tmp, "half.bin"), "wb").write(b"x" * 10)
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    # A failure while replacing keeps the previous version.
    dst.mkdir()
    (dst / "old.txt").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(str(dst), overwrite=True):
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["out"] and (dst / "old.txt").read_text() == "v1"


def _gguf_of_arch(path, arch):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_of_unsupported_architecture(tmp_path):
    src = _gguf_of_arch(tmp_path / "m.gguf", "gpt2")
    r = _cli("gguf", "--src", src, "--dst", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: GGUF architecture 'gpt2' is not supported (supported: llama, minicpm)"
    assert not (tmp_path / "out").exists()


@pytest.mark.smollm2
def test_truncated_gguf(smollm2_gguf, tmp_path):
    src = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        src.write_bytes(f.read(5_000_000))
    r = _cli("gguf", "--src", str(src), "--dst", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "is not a readable GGUF file" in r.stderr and "truncated or corrupt" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["cut.gguf"]


def test_missing_inputs(tmp_path):
    r = _cli("gguf", "--src", str(tmp_path / "none.gguf"), "--dst", str(tmp_path / "o"))
    assert r.returncode != 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _cli("inspect", str(tmp_path))
    assert r.returncode != 0 and "no config.json" in r.stderr


def test_sharded_gguf_output_loads(tmp_path):
    """The HF writer shards by size with an index; a Llama GGUF written here converts and loads."""
    import gguf

    from checkpoints_convert.gguf import convert_gguf

    rng = np.random.default_rng(0)
    h, heads, kv, inter, vocab = 32, 4, 2, 48, 50
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h),
              "blk.0.attn_norm.weight": (h,), "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (h, h),
              "blk.0.attn_k.weight": (kv * h // heads, h), "blk.0.attn_v.weight": (kv * h // heads, h),
              "blk.0.attn_output.weight": (h, h), "blk.0.ffn_gate.weight": (inter, h),
              "blk.0.ffn_up.weight": (inter, h), "blk.0.ffn_down.weight": (h, inter)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dst = str(tmp_path / "hf")
    convert_gguf(str(tmp_path / "tiny.gguf"), dst, shard_bytes=8_000, progress=False, tokenizer=False)
    assert os.path.isfile(os.path.join(dst, "model.safetensors.index.json"))
    model = load_model(dst, dtype=jnp.float32, max_length=16)
    assert model.config.tied_head is False and model.config.num_kv_heads == 2
    with pytest.raises(MiniCPMError, match="destination .* already exists"):
        convert_gguf(str(tmp_path / "tiny.gguf"), dst, progress=False, tokenizer=False)


def test_gguf_tokenizer_without_torch_says_how_to_fix(monkeypatch, tmp_path):
    from checkpoints_convert import gguf

    monkeypatch.setattr(gguf, "torch_installed", lambda: False)  # never patch importlib: transformers caches it
    with pytest.raises(MiniCPMError, match="needs PyTorch.*pip install torch"):
        gguf.save_tokenizer(str(tmp_path / "m.gguf"), str(tmp_path))


def test_damaged_native_checkpoints_are_named(tiny_ckpt, tmp_path):
    import shutil

    from checkpoints_convert.hf import convert_hf

    dst = str(tmp_path / "native")
    convert_hf(tiny_ckpt[0], dst, progress=False)
    # A config that no longer matches the stored parameters: every mis-shaped one is listed before reading.
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump(dict(cfg, intermediate_size=80, num_hidden_layers=2), f)
    with pytest.raises(MiniCPMError) as e:
        load_model(dst)
    msg = str(e.value)
    assert "parameter model.layers.0.mlp.gate_up_proj.kernel has shape [64, 192], expected [64, 160]" in msg
    assert "unexpected parameter model.layers.2.mlp.down_proj.kernel" in msg
    # An Orbax directory whose contents are gone.
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    shutil.rmtree(os.path.join(dst, "params"))
    os.mkdir(os.path.join(dst, "params"))
    with pytest.raises(MiniCPMError, match="params is not a readable Orbax checkpoint"):
        load_model(dst)
