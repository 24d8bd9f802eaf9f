"""MiniCPM GGUF files (llama.cpp's ``minicpm`` architecture) → HF directory, and ``--model_path file.gguf``.

The GGUFs are written here as llama.cpp's ``MiniCPMModel`` converter writes them: arch ``minicpm``, the muP
scalings as ``embedding_scale`` / ``residual_scale`` (scale_depth/sqrt(L)) / ``logit_scale``
(hidden/dim_model_base), LongRoPE factors as ``rope_factors_long/short`` tensors, q/k rows permuted to
llama.cpp's interleaved RoPE order, a SentencePiece ``llama`` tokenizer. Sizes suit every block type
(rows of 256 or 512 values). gguf-py quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it cannot
quantize K-quants, so Q4_K / Q6_K tensors are random blocks with sane scales, and the oracle is what
gguf-py dequantizes them to.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints_convert.gguf import convert_gguf
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.loading import load_model
from tests import helpers

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
IDS = [1, 263, 270, 5, 99, 300, 17, 42, 280, 3, 261, 319]
MAX_LEN = 128  # > original_max_position_embeddings (64): the long factors are used
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _f32(values):
    return [float(np.float32(v)) for v in values]  # the factors are F32 tensors in the file


def _config(**overrides) -> dict:
    cfg = helpers.tiny_minicpm_config(hidden_size=256, intermediate_size=512, head_dim=32, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=320, num_hidden_layers=2, eos_token_id=2)
    rs = cfg["rope_scaling"]
    rs["short_factor"], rs["long_factor"] = _f32(rs["short_factor"]), _f32(rs["long_factor"])
    cfg.update(overrides)
    return cfg


def _vocab():
    """A 320-token SentencePiece vocabulary: unk, bos, eos, 256 byte tokens, chat markers, pieces."""
    pieces = ["\u2581"] + [chr(c) for c in range(97, 123)] + ["\u2581" + chr(c) for c in range(97, 123)]
    pieces += ["he", "ll", "\u2581t", "th", "er", "in"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|im_start|>", "<|im_end|>"] + pieces
    types = [2, 3, 3] + [6] * 256 + [3, 3] + [1] * len(pieces)
    scores = [0.0] * 261 + [-float(i) for i in range(len(pieces))]
    assert len(tokens) == 320
    return tokens, scores, types


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (HF rotate-half → interleaved pairs), applied to rows of any dtype."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K / Q6_K blocks ``uint8[rows, bytes]`` with scales that give weights of about ±0.1."""
    n = cols // 256
    if qtype == Q.Q4_K:  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b = rng.integers(0, 256, (rows, n, 144), dtype=np.uint8)
        b[..., 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        b[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    else:  # Q6_K: 128 + 64 bytes of 6-bit values, 16 int8 scales, d (f16)
        b = rng.integers(0, 256, (rows, n, 210), dtype=np.uint8)
        b[..., 192:208] = rng.integers(-8, 9, (rows, n, 16)).astype(np.int8).view(np.uint8)
        b[..., 208:210] = np.frombuffer(np.float16(4e-4).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def write_minicpm_gguf(path, cfg, weights, types=None, *, orig_ctx=True, key_length=True, seed=0):
    """Writes ``weights`` (HF names) as llama.cpp's MiniCPM converter would; ``types`` maps a GGUF base name
    (``attn_q``, ``token_embd``...) to its tensor type (default F16). Returns the HF-named float32
    weights the file dequantizes to (the oracle)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "minicpm")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if key_length:  # the converter writes these when config.json has head_dim
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(1)
    w.add_embedding_scale(float(cfg["scale_emb"]))
    w.add_residual_scale(cfg["scale_depth"] / layers**0.5)
    w.add_logit_scale(h / cfg["dim_model_base"])
    rs = cfg["rope_scaling"]
    w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if orig_ctx:
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    tokens, scores, toktypes = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    w.add_tensor("rope_factors_long.weight", np.asarray(rs["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rs["short_factor"], np.float32))
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    oracle = {}
    for name, value in weights.items():
        stem = name[: -len(".weight")]
        if stem in names:
            base, gname = names[stem], names[stem]
        else:
            _, _, i, rest = stem.split(".", 3)
            base, gname = per_layer[rest], f"blk.{i}.{per_layer[rest]}"
        rows = {"attn_q": heads, "attn_k": kv}.get(base)
        order = (lambda a: _permute(a, rows)) if rows else (lambda a: a)
        kind = types.get(base, Q.F16) if value.ndim == 2 else Q.F32  # llama.cpp keeps 1-D tensors in F32
        if kind == Q.F32:
            w.add_tensor(gname + ".weight", order(value))
            oracle[name] = value
        elif kind == Q.F16:
            w.add_tensor(gname + ".weight", order(value.astype(np.float16)))
            oracle[name] = value.astype(np.float16).astype(np.float32)
        elif kind in (Q.Q4_K, Q.Q6_K):  # blocks in HF row order, then permuted like the weights
            blocks = _k_blocks(rng, kind, *value.shape)
            w.add_tensor(gname + ".weight", order(blocks), raw_dtype=kind)
            oracle[name] = gguf.quants.dequantize(blocks, kind).reshape(value.shape).astype(np.float32)
        else:
            blocks = gguf.quants.quantize(value, kind)
            w.add_tensor(gname + ".weight", order(blocks), raw_dtype=kind)
            oracle[name] = gguf.quants.dequantize(blocks, kind).reshape(value.shape).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return oracle


def _logits(path):
    model = load_model(path, dtype=jnp.float32, attention_impl="xla", max_length=MAX_LEN)
    logits, _, _ = model(jnp.asarray([IDS], jnp.int32), model.new_cache(1, MAX_LEN))
    return np.asarray(logits[0])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(dir, config, weights, logits) of the source HF MiniCPM4 directory."""
    cfg = _config()
    weights = helpers.random_hf_weights(cfg)
    path = helpers.write_checkpoint(str(tmp_path_factory.mktemp("src") / "hf"), cfg, weights)
    return path, cfg, weights, _logits(path)


def _convert(tmp_path, cfg, weights, types=None, **kw):
    """(converted dir, logits of the HF directory holding the file's dequantized weights, its dir)."""
    oracle = write_minicpm_gguf(tmp_path / "m.gguf", cfg, weights, types, **kw)
    dst = str(tmp_path / "converted")
    convert_gguf(str(tmp_path / "m.gguf"), dst, progress=False, tokenizer=False)
    ref = helpers.write_checkpoint(str(tmp_path / "oracle"), cfg, oracle)
    return dst, ref


def test_config_is_the_sources(source, tmp_path):
    src, cfg, weights, _ = source
    dst, _ = _convert(tmp_path, cfg, weights)
    with open(os.path.join(dst, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "minicpm" and raw["architectures"] == ["MiniCPMForCausalLM"]
    assert raw["scale_emb"] == 12.0 and raw["scale_depth"] == 1.4 and raw["dim_model_base"] == 16
    assert raw["rms_norm_eps"] == 1e-6 and raw["tie_word_embeddings"] is False and "sparse_config" not in raw
    # Everything but InfLLM-v2's sparse_config, which llama.cpp does not store.
    assert ModelConfig.from_pretrained(dst) == dataclasses.replace(ModelConfig.from_pretrained(src), sparse=None)


def test_tied_head_and_llama_cpp_defaults(tmp_path):
    """No output.weight: a tied head. No original-context key (llama.cpp's converter writes none): the
    context length, as llama.cpp assumes. No key_length: head_dim = hidden / heads."""
    cfg = _config(tie_word_embeddings=True, num_hidden_layers=1)
    weights = helpers.random_hf_weights(cfg)
    write_minicpm_gguf(tmp_path / "t.gguf", cfg, weights, orig_ctx=False, key_length=False)
    convert_gguf(str(tmp_path / "t.gguf"), str(tmp_path / "out"), progress=False, tokenizer=False)
    got = ModelConfig.from_pretrained(str(tmp_path / "out"))
    assert got.tied_head and got.head_dim == 32 and got.scale_depth == 1.4
    assert got.rope.kind == "longrope" and got.rope.original_max_position_embeddings == 256
    assert got.rope.long_factor == tuple(cfg["rope_scaling"]["long_factor"])


def test_f16_logits_match_the_source(source, tmp_path):
    _, cfg, weights, want = source
    dst, ref = _convert(tmp_path, cfg, weights)
    got = _logits(dst)
    assert helpers.rel_err(got, _logits(ref)) < 1e-5  # the same fp16-rounded weights
    assert helpers.rel_err(got, want) < 3e-3  # fp16 rounding of the weights, nothing more


def test_q8_0_within_its_own_error(source, tmp_path):
    _, cfg, weights, want = source
    dst, ref = _convert(tmp_path, cfg, weights, {b: Q.Q8_0 for b in ("token_embd", "output", "attn_q", "attn_k",
                                                                     "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                                     "ffn_down")})
    got = _logits(dst)
    assert helpers.rel_err(got, _logits(ref)) < 1e-5
    err = helpers.rel_err(got, want)
    assert 1e-4 < err < 3e-2, err  # really quantized, and only by Q8_0's error


def test_mixed_block_types(source, tmp_path):
    """A Q4_K_M-like mix: K-quants, the legacy 4/5-bit types and BF16, q/k included, in one file."""
    _, cfg, weights, _ = source
    types = {"token_embd": Q.Q6_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q6_K,
             "attn_output": Q.Q4_1, "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_1, "ffn_down": Q.BF16}
    dst, ref = _convert(tmp_path, cfg, weights, types)
    assert helpers.rel_err(_logits(dst), _logits(ref)) < 1e-5


def _run(model_path, cache, *extra):
    env = {**os.environ, "MINICPM_JAX_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "minicpm_jax.run", "--model_path", str(model_path), "--prompt_text",
                           "hi", "--num_generate", "4", "--json_output", "--dtype", "float32", "--max_length", "64",
                           "--ignore_eos", *extra], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=600)


def test_model_path_gguf_through_the_cli(source, tmp_path):
    _, cfg, weights, _ = source
    write_minicpm_gguf(tmp_path / "m.gguf", cfg, weights, {"attn_q": Q.Q8_0, "ffn_down": Q.Q4_K})
    cache = tmp_path / "cache"
    r = _run(tmp_path / "m.gguf", cache)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # nothing but the JSON object on stdout
    assert out["completion_tokens"] == 4 and out["prompt_tokens"] > 5 and out["model_path"].startswith(str(cache))
    (converted,) = os.listdir(cache / "gguf")
    config_file = cache / "gguf" / converted / "config.json"
    stamp = os.stat(config_file).st_mtime_ns
    r2 = _run(tmp_path / "m.gguf", cache)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["token_ids"] == out["token_ids"]  # greedy: the same answer from the cached directory
    assert os.listdir(cache / "gguf") == [converted] and os.stat(config_file).st_mtime_ns == stamp  # not reconverted


def test_changed_file_is_converted_again(source, tmp_path, monkeypatch):
    from minicpm_jax.cli.demo import ensure_converted_gguf

    _, cfg, weights, _ = source
    monkeypatch.setenv("MINICPM_JAX_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    write_minicpm_gguf(src, cfg, weights)
    first = ensure_converted_gguf(str(src), progress=False)
    assert ensure_converted_gguf(str(src), progress=False) == first
    from transformers import PreTrainedTokenizerFast

    tokens = _vocab()[0]
    tok = PreTrainedTokenizerFast.from_pretrained(first)  # the GGUF's vocabulary, ids as in the file
    assert tok.convert_tokens_to_ids(["<|im_start|>", "</s>", "\u2581h"]) == [259, 2, tokens.index("\u2581h")]
    assert "<|im_start|>assistant" in tok.chat_template
    os.utime(src, ns=(os.stat(src).st_atime_ns, os.stat(src).st_mtime_ns + 10**9))
    second = ensure_converted_gguf(str(src), progress=False)
    assert second != first and os.path.isfile(os.path.join(second, "model.safetensors"))


def test_bad_gguf_files_give_one_line(source, tmp_path, monkeypatch):
    """A truncated file and another architecture: one-line MiniCPMErrors (the CLI prints them as its one
    ``error:`` line), and nothing left in the cache to be reused."""
    from minicpm_jax.cli.demo import ensure_converted_gguf

    _, cfg, weights, _ = source
    monkeypatch.setenv("MINICPM_JAX_CACHE", str(tmp_path / "cache"))
    write_minicpm_gguf(tmp_path / "m.gguf", cfg, weights)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(MiniCPMError, match=r"^\S*cut.gguf is not a readable GGUF file .*truncated or corrupt$"):
        ensure_converted_gguf(str(tmp_path / "cut.gguf"), progress=False)
    cached = tmp_path / "cache" / "gguf"
    assert not cached.exists() or os.listdir(cached) == []

    other = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    other.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(MiniCPMError, match=r"^GGUF architecture 'phi3' is not supported \(supported: llama, minicpm\)$"):
        ensure_converted_gguf(str(tmp_path / "phi.gguf"), progress=False)
    assert not cached.exists() or os.listdir(cached) == []
