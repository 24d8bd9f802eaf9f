"""GGUF → Hugging Face style directory: config.json, safetensors, tokenizer files.

Two llama.cpp architectures are read:

- ``llama``: a Llama config (``model_type`` llama).
- ``minicpm`` (llama.cpp's ``MiniCPMModel`` converter, e.g. the MiniCPM4-8B GGUFs): a MiniCPM config
  (``model_type`` minicpm). The muP scalings come back from ``minicpm.embedding_scale`` (= ``scale_emb``),
  ``minicpm.residual_scale`` (= ``scale_depth / sqrt(num_layers)``) and ``minicpm.logit_scale``
  (= ``hidden_size / dim_model_base``: llama.cpp divides by it). LongRoPE comes back from the
  ``rope_factors_long`` / ``rope_factors_short`` tensors (``long_factor`` / ``short_factor``) with
  ``original_max_position_embeddings`` from ``minicpm.rope.scaling.original_context_length`` where the file
  has it, else the context length (llama.cpp's own default; its MiniCPM converter does not write the key).
  Not recoverable, so left out: ``sparse_config`` (llama.cpp has no InfLLM-v2: the model runs with dense
  attention unless ``--sparse on``), a second EOS id (the file stores one), MoE MiniCPM files (refused).

For both, the head is untied exactly when the file has an ``output.weight`` tensor; BOS/EOS/PAD ids come
from the tokenizer metadata; float32 metadata is read back as the shortest decimal that rounds to the stored
float32 (``1e-06``, not ``9.99999997e-07``; ``scale_depth`` 1.4, not 1.4000000206). Tensors are dequantized
with the ``gguf`` package (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K and the rest it supports); llama.cpp's
interleaved q/k row order is undone so the result uses the HF rotate-half RoPE. The tokenizer (a
SentencePiece ``llama`` vocabulary for both architectures) is rebuilt by transformers' GGUF reader.
"""

from __future__ import annotations

import math
import os

import numpy as np

from checkpoints_convert.common import (
    DEFAULT_SHARD_BYTES, ShardedSafetensorsWriter, atomic_output_dir, check_destination, write_json,
)
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError

SUPPORTED_ARCHITECTURES = ("llama", "minicpm")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16"}


def open_gguf(path: str):
    """``gguf.GGUFReader`` with MiniCPMError for missing, truncated or non-GGUF files."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise MiniCPMError(f"GGUF file {path!r} does not exist")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on damaged files
        raise MiniCPMError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be truncated or corrupt") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _decimal(stored: float, inverse=lambda x: x, forward=lambda x: x) -> float:
    """The shortest decimal ``x`` with ``float32(forward(x)) == stored``, searched around ``inverse(stored)``.

    GGUF metadata is float32; the HF config held a short decimal (``1e-6``, ``1.4``) that this recovers.
    """
    target = np.float32(stored)
    approx = inverse(float(target))
    for digits in range(1, 18):
        x = float(f"{approx:.{digits}g}")
        if x and np.float32(forward(x)) == target:
            return x
    return approx


def _common_config(reader, arch: str, names: set[str]) -> dict:
    """The fields llama and minicpm files store alike, as HF ``config.json`` entries."""
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise MiniCPMError("GGUF file has no token_embd.weight tensor")
    for key in ("embedding_length", "attention.head_count", "block_count", "feed_forward_length"):
        if _field(reader, f"{arch}.{key}") is None:
            raise MiniCPMError(f"GGUF file has no {arch}.{key} metadata; it is not a complete {arch} model")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.rope.dimension_count"))
    return {
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": _decimal(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "rope_theta": _decimal(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _llama_config(reader, names: set[str]) -> dict:
    if "rope_freqs.weight" in names:
        raise MiniCPMError("GGUF tensor rope_freqs.weight (Llama-3.1 rope factors) is not supported; convert from the HF checkpoint")
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise MiniCPMError(f"GGUF llama.rope.scaling.type {scaling!r} is not supported")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_common_config(reader, "llama", names)}
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _decimal(_field(reader, "llama.rope.scaling.factor", 1.0))}
    return cfg


def _rope_factors(reader, name: str) -> list[float]:
    tensor = next(t for t in reader.tensors if t.name == name)
    return [float(v) for v in dequantize(tensor).reshape(-1)]


def _minicpm_config(reader, names: set[str]) -> dict:
    if any(n.endswith(("ffn_gate_inp.weight", "ffn_gate_exps.weight")) for n in names):
        raise MiniCPMError("GGUF file is a mixture-of-experts MiniCPM; only dense MiniCPM models are supported")
    cfg = {"architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm", **_common_config(reader, "minicpm", names)}
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    root = math.sqrt(layers)
    for key in ("embedding_scale", "residual_scale", "logit_scale"):
        value = _field(reader, f"minicpm.{key}")
        if not isinstance(value, (int, float)) or not value > 0:
            raise MiniCPMError(f"GGUF minicpm.{key} must be a positive number, got {value!r}")
    dim_model_base = _decimal(_field(reader, "minicpm.logit_scale"), lambda s: hidden / s, lambda x: hidden / x)
    cfg.update(
        scale_emb=_decimal(_field(reader, "minicpm.embedding_scale")),
        scale_depth=_decimal(_field(reader, "minicpm.residual_scale"), lambda s: s * root, lambda x: x / root),
        dim_model_base=int(dim_model_base) if dim_model_base.is_integer() else dim_model_base,
    )
    scaling = _field(reader, "minicpm.rope.scaling.type")
    has_factors = {"rope_factors_long.weight", "rope_factors_short.weight"} <= names
    if scaling not in (None, "none", "longrope"):
        raise MiniCPMError(f"GGUF minicpm.rope.scaling.type {scaling!r} is not supported (only longrope)")
    if scaling == "longrope" and not has_factors:
        raise MiniCPMError("GGUF minicpm file says rope scaling longrope but has no rope_factors_long/short tensors")
    if has_factors:  # llama.cpp applies the factors whenever the tensors are there
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _rope_factors(reader, "rope_factors_long.weight"),
            "short_factor": _rope_factors(reader, "rope_factors_short.weight"),
            "original_max_position_embeddings": int(_field(
                reader, "minicpm.rope.scaling.original_context_length", cfg["max_position_embeddings"])),
        }
    return cfg


def gguf_config(reader) -> dict:
    """An HF ``config.json`` dict (model_type llama or minicpm) from GGUF metadata; MiniCPMError if unsupported."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MiniCPMError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    cfg = _llama_config(reader, names) if arch == "llama" else _minicpm_config(reader, names)
    ModelConfig.from_dict(cfg)  # validates
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row interleaving: rows (head, pair, half) → (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> tuple[str, str] | None:
    """HF tensor name and the GGUF base name (``attn_q``...), or None for tensors HF has no use for."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.weight", base
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight", parts[2]
    return None


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in HF order (``[out, in]`` for matrices)."""
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise MiniCPMError(f"GGUF tensor {tensor.name} has type {kind}, not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    out = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(s) for s in reversed(tensor.shape))
    return np.asarray(out, np.float32).reshape(shape)


def convert_gguf(
    src: str,
    dst: str,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    tokenizer: bool = True,
) -> dict:
    """Converts ``src`` (a .gguf file) into the HF-style directory ``dst`` atomically; returns the config."""
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise MiniCPMError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_destination(dst, overwrite)
    reader = open_gguf(src)
    cfg = gguf_config(reader)
    np_dtype = DTYPES[dtype]
    if np_dtype == "bfloat16":
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    with atomic_output_dir(dst, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, shard_bytes)
        for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
            mapped = hf_name(tensor.name)
            if mapped is None:
                continue
            name, base = mapped
            w = dequantize(tensor)
            if base == "attn_q":
                w = _unpermute(w, cfg["num_attention_heads"])
            elif base == "attn_k":
                w = _unpermute(w, cfg["num_key_value_heads"])
            writer.add(name, w.astype(np_dtype))
        writer.close()
        write_json(os.path.join(tmp, "config.json"), {**cfg, "torch_dtype": dtype})
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        write_json(os.path.join(tmp, "generation_config.json"), gen)
        if tokenizer:
            save_tokenizer(src, tmp, reader)
    return cfg


def torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def save_tokenizer(src: str, out_dir: str, reader=None) -> None:
    """Saves the GGUF's tokenizer and chat template as HF tokenizer files (transformers' GGUF support).

    transformers reads tokenizers only from files of architectures it knows; a ``minicpm`` file's
    tokenizer (a SentencePiece ``llama`` vocabulary) is read from a metadata-only copy tagged ``llama``.
    """
    import tempfile

    from transformers import AutoTokenizer

    if not torch_installed():  # transformers' GGUF metadata reader imports torch
        raise MiniCPMError(
            "reading a GGUF tokenizer needs PyTorch (transformers' GGUF reader imports it); install the CPU "
            "build: pip install torch --index-url https://download.pytorch.org/whl/cpu"
        )
    reader = reader if reader is not None else open_gguf(src)
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as tmp:
        path = os.path.abspath(src)
        if _field(reader, "general.architecture") != "llama":
            path = _tokenizer_only_copy(reader, os.path.join(tmp, "tokenizer.gguf"))
        try:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        except Exception as e:
            raise MiniCPMError(f"cannot read the tokenizer from {src}: {type(e).__name__}: {e}") from None
    tok.save_pretrained(out_dir)


def _tokenizer_only_copy(reader, path: str) -> str:
    """Writes the ``tokenizer.*`` metadata of ``reader`` into a tensor-less GGUF of architecture llama."""
    from gguf import GGUFValueType, GGUFWriter

    if "tokenizer.ggml.tokens" not in reader.fields:
        raise MiniCPMError("GGUF file has no tokenizer (no tokenizer.ggml.tokens metadata)")
    writer = GGUFWriter(path, "llama")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or not field.types:
            continue
        kind = GGUFValueType(field.types[0])
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, sub_type=GGUFValueType(field.types[-1]))
        else:
            writer.add_key_value(key, field.contents(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
