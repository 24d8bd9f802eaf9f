"""int4 checkpoints → the arrays of the engine's int4 linears.

Reads GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers: ``qweight``, ``qzeros``, ``scales``,
``g_idx`` per linear; v1 and v2 zero points; sym and asym; act-order) and CPM.cu's marlin-cpmcu
checkpoints (``model_gptq.safetensors``: fused ``qkv_proj`` / ``gate_up_proj``, Marlin-packed
``qweight`` and permuted ``scales``), for targets and drafts alike. Every linear goes through
:class:`~minicpm_jax.io.int4_formats.Int4Weight` and is repacked into the engine layout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import numpy as np

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io import int4_formats
from minicpm_jax.io.names import Linear
from minicpm_jax.quant import CheckpointQuant, QuantSpec, parse_quantization_config, scale_dtype

MARLIN_CPMCU_FILE = "model_gptq.safetensors"  # what CPM.cu's gptq2marlin.py writes


def is_marlin_packed(shape: tuple[int, ...] | None, linear: Linear) -> bool:
    """Whether a ``qweight`` of ``shape`` for the first checkpoint linear of ``linear`` is Marlin-packed
    (``[K/16, 2N]``, where GPTQ's is ``[K/8, N]``)."""
    return shape == (linear.in_features // 16, 2 * linear.widths[0])


def checkpoint_quant(where: str, settings: dict | None, names: set[str], shape_of: Callable, probe: Linear, *,
                     marlin_file: bool = False, declared_needs_codes: bool = True) -> CheckpointQuant | None:
    """The quantization of a checkpoint, or None when it is dense.

    settings: its ``quantization_config`` (config.json) or ``quantize_config.json``; without either, a
    ``marlin_file`` checkpoint is read as CPM.cu's marlin-cpmcu default (sym; the group size from the
    scales, 128 for MiniCPM4). Marlin packing is recognised from the ``qweight`` shape of ``probe`` (CPM.cu
    keeps the GPTQ source's config). ``declared_needs_codes``: settings without any ``*.qweight`` tensor are
    an error (else the checkpoint counts as dense). ``shape_of(name)`` reads a tensor's shape.
    """
    if not any(n.endswith(".qweight") for n in names):
        if settings is not None and declared_needs_codes:
            raise MiniCPMError(f"{where}: config.json declares quantization ({settings.get('quant_method', 'gptq')}) "
                               "but the checkpoint has no *.qweight tensors")
        return None
    name = probe.prefixes[0] + ".qweight"
    shape = shape_of(name) if name in names else None
    if settings is None:
        if not marlin_file:
            raise MiniCPMError(
                f"{where} holds *.qweight tensors but no quantization_config (config.json) or quantize_config.json")
        # CPM.cu's own layout: symmetric; the group size follows from the scales (128 for MiniCPM4)
        scales = probe.prefixes[0] + ".scales"
        rows = shape_of(scales)[0] if scales in names else 0
        k = probe.in_features
        group = -1 if rows == 1 else (k // rows if rows and k % rows == 0 else 128)
        settings = {"bits": 4, "group_size": group, "sym": True, "desc_act": False, "checkpoint_format": "marlin"}
    ck = parse_quantization_config(settings)
    if is_marlin_packed(shape, probe) and ck.checkpoint_format != "marlin":
        if not ck.spec.sym or ck.spec.act_order:
            raise MiniCPMError(f"{name} is Marlin-packed, but the config says sym=false or desc_act=true")
        ck = CheckpointQuant(ck.spec, "marlin")
    return ck


def _expected(linear: Linear, width: int, ck: CheckpointQuant) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{tensor suffix: (shape, required)}`` of one checkpoint linear."""
    k = linear.in_features
    groups = k // ck.spec.rows_per_group(k)
    if ck.checkpoint_format == "marlin":
        return {"qweight": ((k // 16, 2 * width), True), "scales": ((groups, width), True)}
    return {
        "qweight": ((k // 8, width), True),
        "scales": ((groups, width), True),
        "qzeros": ((groups, width // 8), not ck.spec.sym),
        "g_idx": ((k,), False),
    }


def check_int4_tensors(linears: Iterable[Linear], ck: CheckpointQuant, shape_of: Callable,
                       names: set[str]) -> tuple[list[str], set[str]]:
    """(problems, tensor names used) for every int4 linear; ``shape_of(name)`` reads a tensor's shape."""
    problems, used = [], set()
    for linear in linears:
        for prefix, width in zip(linear.prefixes, linear.widths):
            for suffix, (shape, required) in _expected(linear, width, ck).items():
                name = f"{prefix}.{suffix}"
                if name not in names:
                    if required:
                        problems.append(f"missing tensor {name} (expected shape {list(shape)})")
                    continue
                used.add(name)
                if shape_of(name) != shape:
                    problems.append(f"tensor {name} has shape {list(shape_of(name))}, expected {list(shape)}")
    return problems, used


def read_int4_linear(linear: Linear, ck: CheckpointQuant, get: Callable) -> int4_formats.Int4Weight:
    """One (fused) linear as :class:`~minicpm_jax.io.int4_formats.Int4Weight`; ``get(name)`` reads a tensor
    or returns None."""
    spec = ck.spec
    gs = spec.rows_per_group(linear.in_features)
    parts = []
    for prefix in linear.prefixes:
        qweight = np.asarray(get(prefix + ".qweight"))
        scales = np.asarray(get(prefix + ".scales"), np.float32)
        if ck.checkpoint_format == "marlin":
            q = int4_formats.marlin_unpack(qweight)
            scales = int4_formats.marlin_unpermute_scales(scales, per_channel=scales.shape[0] == 1)
            g_idx = np.arange(linear.in_features, dtype=np.int32) // gs
            parts.append(int4_formats.Int4Weight(q, scales, None, g_idx, gs))
            continue
        qzeros, g_idx = get(prefix + ".qzeros"), get(prefix + ".g_idx")
        w = int4_formats.gptq_unpack(
            qweight, None if qzeros is None else np.asarray(qzeros), scales, None if g_idx is None else np.asarray(g_idx),
            group_size=spec.group_size, sym=spec.sym, checkpoint_format=ck.checkpoint_format, name=prefix,
        )
        if not spec.act_order and not w.trivial_g_idx:
            raise MiniCPMError(f"{prefix}.g_idx reorders rows although the config says desc_act=false")
        parts.append(w)
    return parts[0] if len(parts) == 1 else int4_formats.concat_columns(parts)


def engine_arrays(w: int4_formats.Int4Weight, spec: QuantSpec, dtype) -> dict[str, np.ndarray]:
    """The parameters of an int4 linear holding ``w`` (``qweight``, ``scales``, and ``zeros`` / ``perm``
    as ``spec`` requires), scales and zeros in the model's :func:`~minicpm_jax.quant.scale_dtype`."""
    arrays = int4_formats.to_engine(w)
    if spec.act_order and "perm" not in arrays:
        arrays["perm"] = np.arange(w.q.shape[0], dtype=np.int32)
    if not spec.sym and "zeros" not in arrays:
        arrays["zeros"] = np.full(arrays["scales"].shape, int4_formats.SYM_ZERO, np.float32)
    sdt = scale_dtype(dtype)
    for key in ("scales", "zeros"):
        if key in arrays:
            arrays[key] = arrays[key].astype(sdt)
    return arrays


def rtn_arrays(kernel: np.ndarray, spec: QuantSpec, dtype) -> dict[str, np.ndarray]:
    """Round-to-nearest int4 of a dense ``kernel [K, N]`` → int4 linear parameters (no act-order)."""
    gs = spec.rows_per_group(kernel.shape[0])
    w = int4_formats.rtn_quantize(np.asarray(kernel, np.float32), group_size=gs, sym=spec.sym)
    return engine_arrays(w, dataclasses.replace(spec, act_order=False), dtype)
