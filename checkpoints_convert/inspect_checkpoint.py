"""``inspect PATH``: what a checkpoint holds (HF directory, native directory or GGUF file)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.hf import hf_checkpoint_quant
from minicpm_jax.io.names import resolve_tied_head
from minicpm_jax.io.native import is_native, native_metadata, native_quant
from minicpm_jax.io.safetensors import safetensors_files

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "I8": "int8",
                       "U8": "uint8", "I64": "int64", "F64": "float64", "BOOL": "bool"}


def _hf_tensors(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    out = {}
    files = safetensors_files(path)
    for file in sorted(set(files.values())):
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (tuple(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()))
    return out


def _gguf_tensors(path: str) -> tuple[dict, dict]:
    from checkpoints_convert.gguf import gguf_config, open_gguf

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    tensors = {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}
    return cfg, tensors


def inspect(path: str) -> dict:
    """A summary dict: format, config fields, tensors with shapes and dtypes, parameter count."""
    if not os.path.exists(path):
        raise MiniCPMError(f"{path!r} does not exist")
    if os.path.isfile(path) and path.endswith(".gguf"):
        raw, tensors = _gguf_tensors(path)
        config, fmt = ModelConfig.from_dict(raw), "gguf"
    else:
        config = ModelConfig.from_pretrained(path)  # validates / raises clear errors
        fmt = "native" if is_native(path) else "hf-safetensors"
        tensors = native_metadata(path) if fmt == "native" else _hf_tensors(path)
    int4 = None
    if fmt == "native":
        spec = native_quant(path)
        int4 = None if spec is None else dict(spec.to_dict(), stored="native")
    elif fmt == "hf-safetensors":
        files = safetensors_files(path)
        ck = hf_checkpoint_quant(path, resolve_tied_head(config, set(files)), files)
        int4 = None if ck is None else dict(ck.spec.to_dict(), stored=ck.checkpoint_format)
    # int4 tensors pack 8 (GPTQ) codes per element: count the model's weights from its config instead
    count = config.num_params if int4 else int(sum(np.prod(shape) for shape, _ in tensors.values()))
    dtypes: dict[str, int] = {}
    for _, dt in tensors.values():
        dtypes[dt] = dtypes.get(dt, 0) + 1
    return {
        "path": path,
        "format": fmt,
        "model_type": config.model_type,
        "layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": f"{config.num_heads} query / {config.num_kv_heads} kv, head_dim {config.head_dim}",
        "vocab_size": config.vocab_size,
        "rope": config.rope.kind,
        "tied_head": config.tied_head,
        "parameters": count,
        "tensor_dtypes": dtypes,
        "quantization": config.quantization,
        "int4": int4,
        "sparse": None if config.sparse is None else dataclasses.asdict(config.sparse),
        "tensors": {name: {"shape": list(shape), "dtype": dt} for name, (shape, dt) in sorted(tensors.items())},
    }


def format_summary(info: dict, show_tensors: bool = True) -> str:
    lines = [
        f"path:          {info['path']}",
        f"format:        {info['format']}",
        f"model_type:    {info['model_type']}",
        f"layers:        {info['layers']}   hidden: {info['hidden_size']}   heads: {info['heads']}",
        f"vocab:         {info['vocab_size']}   rope: {info['rope']}   tied head: {info['tied_head']}",
        f"parameters:    {info['parameters']:,} ({info['parameters'] / 1e9:.3f} B)",
        f"tensor dtypes: {', '.join(f'{k} x{v}' for k, v in sorted(info['tensor_dtypes'].items()))}",
        f"quantization:  {json.dumps(info['quantization']) if info['quantization'] else 'none'}",
        f"int4 weights:  {json.dumps(info['int4']) if info['int4'] else 'none'}",
        f"sparse:        {json.dumps(info['sparse']) if info['sparse'] else 'none'}",
    ]
    if show_tensors:
        lines.append(f"tensors ({len(info['tensors'])}):")
        lines += [f"  {name:<60} {str(t['shape']):<16} {t['dtype']}" for name, t in info["tensors"].items()]
    return "\n".join(lines)
