"""int4 checkpoints → :class:`~minicpm_jax.layers.Int4Linear` parameters, and int4 ↔ dense conversion.

Reads GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers: ``qweight``, ``qzeros``, ``scales``,
``g_idx`` per linear; v1 and v2 zero points; sym and asym; act-order) and CPM.cu's marlin-cpmcu
checkpoints (``model_gptq.safetensors``: fused ``qkv_proj`` / ``gate_up_proj``, Marlin-packed
``qweight`` and permuted ``scales``). Every linear goes through :class:`minicpm_jax.int4.Int4Weight` and
is repacked into the engine layout of the model's :class:`~minicpm_jax.quant.QuantSpec`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm_jax import int4
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.layers import scale_dtype
from minicpm_jax.quant import (
    QUANTIZED_LINEARS,
    CheckpointQuant,
    QuantSpec,
    parse_quantization_config,
    read_quantize_config,
)

MARLIN_CPMCU_FILE = "model_gptq.safetensors"  # what CPM.cu's gptq2marlin.py writes


@dataclasses.dataclass(frozen=True)
class Int4Source:
    """One engine int4 linear and the checkpoint linears it is fused from (their prefixes and widths)."""

    path: tuple  # the Int4Linear's module path, e.g. ("model", "layers", 0, "self_attn", "qkv_proj")
    prefixes: tuple[str, ...]
    widths: tuple[int, ...]
    in_features: int


def linear_shapes(config: ModelConfig) -> dict[tuple[str, str], tuple[int, tuple[tuple[str, int], ...]]]:
    """``{(module, linear): (K, ((checkpoint name, N), ...))}``: the split checkpoint linears of each fused one."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_heads * d, config.num_kv_heads * d
    return {
        ("self_attn", "qkv_proj"): (h, (("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv))),
        ("self_attn", "o_proj"): (nq, (("o_proj", h),)),
        ("mlp", "gate_up_proj"): (h, (("gate_proj", i), ("up_proj", i))),
        ("mlp", "down_proj"): (i, (("down_proj", h),)),
    }


def int4_sources(config: ModelConfig, names: set[str]) -> list[Int4Source]:
    """The checkpoint linears behind every Int4Linear; fused (``qkv_proj``) or split (``q_proj``...) by
    what ``names`` holds."""
    out = []
    for layer in range(config.num_layers):
        pre = f"model.layers.{layer}."
        for (module, linear), (k, parts) in linear_shapes(config).items():
            fused = f"{pre}{module}.{linear}"
            if len(parts) > 1 and fused + ".qweight" in names:
                prefixes, widths = (fused,), (sum(n for _, n in parts),)
            else:
                prefixes = tuple(f"{pre}{module}.{name}" for name, _ in parts)
                widths = tuple(n for _, n in parts)
            out.append(Int4Source(("model", "layers", layer, module, linear), prefixes, widths, k))
    return out


def checkpoint_quant(path: str, config: ModelConfig, files: dict[str, str]) -> CheckpointQuant | None:
    """The quantization of a safetensors checkpoint, or None when it is dense.

    Settings come from config.json's ``quantization_config`` or ``quantize_config.json``; a
    ``model_gptq.safetensors`` without either is read as CPM.cu's marlin-cpmcu default (sym, group 128).
    Marlin packing is recognised from tensor shapes (CPM.cu keeps the GPTQ source's config).
    """
    raw = config.quantization or read_quantize_config(path)
    qnames = [n for n in files if n.endswith(".qweight")]
    if not qnames:
        if raw is not None:
            raise MiniCPMError(
                f"{path}: config.json declares quantization ({raw.get('quant_method', 'gptq')}) but the "
                "checkpoint has no *.qweight tensors"
            )
        return None
    from minicpm_jax.weights import _TensorReader  # the safetensors reader (weights imports this module)

    src = next(s for s in int4_sources(config, set(files)) if s.path[-1] == "o_proj")
    name = src.prefixes[0] + ".qweight"
    with _TensorReader(files) as reader:
        shape = reader.shape(name) if name in files else None
        scale_rows = reader.shape(src.prefixes[0] + ".scales")[0] if src.prefixes[0] + ".scales" in files else 0
    marlin_file = any(os.path.basename(f) == MARLIN_CPMCU_FILE for f in files.values())
    if raw is None:
        if not marlin_file:
            raise MiniCPMError(
                f"{path} holds *.qweight tensors but no quantization_config (config.json) or quantize_config.json"
            )
        # CPM.cu's own layout: symmetric; the group size follows from the scales (128 for MiniCPM4)
        k = src.in_features
        group = -1 if scale_rows == 1 else (k // scale_rows if scale_rows and k % scale_rows == 0 else 128)
        raw = {"bits": 4, "group_size": group, "sym": True, "desc_act": False, "checkpoint_format": "marlin"}
    ck = parse_quantization_config(raw)
    if shape is not None:
        if shape == (src.in_features // 16, 2 * src.widths[0]) and ck.checkpoint_format != "marlin":
            if not ck.spec.sym or ck.spec.act_order:
                raise MiniCPMError(f"{name} is Marlin-packed, but the config says sym=false or desc_act=true")
            ck = CheckpointQuant(ck.spec, "marlin")
    return ck


def _expected(src: Int4Source, width: int, ck: CheckpointQuant) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{tensor suffix: (shape, required)}`` of one checkpoint linear."""
    k = src.in_features
    groups = k // ck.spec.rows_per_group(k)
    if ck.checkpoint_format == "marlin":
        return {"qweight": ((k // 16, 2 * width), True), "scales": ((groups, width), True)}
    return {
        "qweight": ((k // 8, width), True),
        "scales": ((groups, width), True),
        "qzeros": ((groups, width // 8), not ck.spec.sym),
        "g_idx": ((k,), False),
    }


def check_int4_tensors(sources: list[Int4Source], ck: CheckpointQuant, shape_of, names: set[str]) -> tuple[list[str], set[str]]:
    """(problems, tensor names used) for every int4 linear; ``shape_of(name)`` reads a tensor's shape."""
    problems, used = [], set()
    for src in sources:
        for prefix, width in zip(src.prefixes, src.widths):
            for suffix, (shape, required) in _expected(src, width, ck).items():
                name = f"{prefix}.{suffix}"
                if name not in names:
                    if required:
                        problems.append(f"missing tensor {name} (expected shape {list(shape)})")
                    continue
                used.add(name)
                if shape_of(name) != shape:
                    problems.append(f"tensor {name} has shape {list(shape_of(name))}, expected {list(shape)}")
    return problems, used


def read_int4_linear(src: Int4Source, ck: CheckpointQuant, get) -> int4.Int4Weight:
    """One (fused) linear as :class:`~minicpm_jax.int4.Int4Weight`; ``get(name)`` reads a tensor or None."""
    spec = ck.spec
    gs = spec.rows_per_group(src.in_features)
    parts = []
    for prefix in src.prefixes:
        qweight = np.asarray(get(prefix + ".qweight"))
        scales = np.asarray(get(prefix + ".scales"), np.float32)
        if ck.checkpoint_format == "marlin":
            q = int4.marlin_unpack(qweight)
            scales = int4.marlin_unpermute_scales(scales, per_channel=scales.shape[0] == 1)
            g_idx = np.arange(src.in_features, dtype=np.int32) // gs
            parts.append(int4.Int4Weight(q, scales, None, g_idx, gs))
            continue
        qzeros, g_idx = get(prefix + ".qzeros"), get(prefix + ".g_idx")
        w = int4.gptq_unpack(
            qweight, None if qzeros is None else np.asarray(qzeros), scales, None if g_idx is None else np.asarray(g_idx),
            group_size=spec.group_size, sym=spec.sym, checkpoint_format=ck.checkpoint_format, name=prefix,
        )
        if not spec.act_order and not w.trivial_g_idx:
            raise MiniCPMError(f"{prefix}.g_idx reorders rows although the config says desc_act=false")
        parts.append(w)
    return parts[0] if len(parts) == 1 else int4.concat_columns(parts)


def engine_arrays(w: int4.Int4Weight, spec: QuantSpec, dtype) -> dict[str, np.ndarray]:
    """The parameters of an Int4Linear holding ``w`` (``qweight``, ``scales``, and ``zeros`` / ``perm``
    as ``spec`` requires), scales and zeros in the model's :func:`~minicpm_jax.layers.scale_dtype`."""
    arrays = int4.to_engine(w, spec.layout)
    if spec.act_order and "perm" not in arrays:
        arrays["perm"] = np.arange(w.q.shape[0], dtype=np.int32)
    if not spec.sym and "zeros" not in arrays:
        arrays["zeros"] = np.full(arrays["scales"].shape, int4.SYM_ZERO, np.float32)
    sdt = scale_dtype(dtype)
    for key in ("scales", "zeros"):
        if key in arrays:
            arrays[key] = arrays[key].astype(sdt)
    return arrays


def load_int4_params(sources: list[Int4Source], ck: CheckpointQuant, spec: QuantSpec, get, dtype) -> Iterator:
    """Yields ``(param path, array)`` of every Int4Linear, repacked for the model's ``spec``."""
    for src in sources:
        w = read_int4_linear(src, ck, get)
        for key, value in engine_arrays(w, spec, dtype).items():
            yield src.path + (key,), jnp.asarray(value)


# ------------------------------------------------------------------------------------- int4 ↔ dense
def _linear_modules(model) -> Iterator[tuple[tuple, nnx.Module]]:
    for i, layer in enumerate(model.model.layers):
        for module, linear in QUANTIZED_LINEARS:
            yield ("model", "layers", i, module, linear), getattr(getattr(layer, module), linear)


def linear_to_int4(kernel: np.ndarray, spec: QuantSpec, dtype) -> dict[str, np.ndarray]:
    """Round-to-nearest int4 of a dense ``kernel [K, N]`` → Int4Linear parameters."""
    gs = spec.rows_per_group(kernel.shape[0])
    w = int4.rtn_quantize(np.asarray(kernel, np.float32), group_size=gs, sym=spec.sym)
    return engine_arrays(w, dataclasses.replace(spec, act_order=False), dtype)


def int4_linear_weight(linear) -> int4.Int4Weight:
    """An Int4Linear's parameters back as :class:`~minicpm_jax.int4.Int4Weight` (original row order)."""
    arrays = {key: np.asarray(getattr(linear, key)[...]) for key in ("qweight", "scales", "zeros", "perm")
              if hasattr(linear, key)}
    return int4.from_engine(arrays, linear.group_size, linear.layout)


def convert_model(model, quant: QuantSpec | None):
    """``model`` with its decoder linears re-stored as ``quant`` (None: dense, dequantized weights;
    a spec: round-to-nearest int4 of dense weights). Other parameters are shared, not copied."""
    from minicpm_jax.weights import abstract_model, fill_model

    if quant is not None and model.quant is not None:
        raise MiniCPMError("the model is already int4; re-quantizing int4 weights is not supported")
    if quant is not None:
        quant = dataclasses.replace(quant, act_order=False)
    target = abstract_model(model.config, max_length=model.max_length, attention_impl=model.attention_impl,
                            dtype=model.dtype, quant=quant, sparse=model.sparse)

    def params():
        linears = dict(_linear_modules(model))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if path[:5] not in linears:
                yield path, var[...]
        for path, linear in linears.items():
            if quant is None:
                yield path + ("kernel",), jnp.asarray(int4_linear_weight(linear).dequantize(), model.dtype)
            else:
                for key, value in linear_to_int4(np.asarray(linear.kernel[...], np.float32), quant, model.dtype).items():
                    yield path + (key,), jnp.asarray(value)

    return fill_model(target, params())
