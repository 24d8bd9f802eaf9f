"""Weight quantization settings: the ``QuantSpec`` a model is built with, and the parsing of a
checkpoint's ``quantization_config`` (GPTQ / marlin) into one.

Only W4A16 is supported: 4-bit unsigned codes, per-group scales over ``group_size`` input rows (−1: one
group over all of them), zero points when asymmetric, and an optional row permutation (GPTQ act-order).
The linears of every decoder layer are quantized (fused ``qkv_proj``, ``o_proj``, fused ``gate_up_proj``,
``down_proj``); embeddings, norms and ``lm_head`` stay in the model dtype, as in CPM.cu.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from minicpm_jax.config import read_json_object
from minicpm_jax.errors import MiniCPMError

QUANT_CHOICES = ("auto", "none", "int4")
CHECKPOINT_FORMATS = ("gptq", "gptq_v2", "marlin")
QUANTIZED_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How the decoder linears of a model are stored in memory (always GPTQ-native words ``[K/8, N]``).

    group_size: input rows per scale group, or −1 for one group per output column (per-channel).
    sym: symmetric codes (zero point 8, no ``zeros`` parameter).
    act_order: every linear carries ``perm int32 [K]`` (GPTQ ``desc_act``: rows stored sorted by group).
    """

    group_size: int = 128
    sym: bool = True
    act_order: bool = False

    def __post_init__(self):
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 16):
            raise MiniCPMError(f"int4 group_size must be -1 (per-channel) or a positive multiple of 16, got {self.group_size}")

    def rows_per_group(self, in_features: int) -> int:
        """The group size of a linear with ``in_features`` inputs; MiniCPMError when it does not divide."""
        gs = in_features if self.group_size == -1 else self.group_size
        if in_features % gs:
            raise MiniCPMError(
                f"int4 group_size {self.group_size} does not divide a linear's {in_features} input features "
                "(choose a group size that divides hidden_size and intermediate_size, e.g. 64 or 32)"
            )
        return gs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "QuantSpec":
        """Reads :meth:`to_dict`'s output (also that of earlier versions, which named the one in-memory
        layout, ``kpacked``)."""
        raw = dict(raw)
        if raw.pop("layout", "kpacked") != "kpacked":
            raise MiniCPMError(f"bad int4 settings {raw!r}: only the kpacked in-memory layout exists; re-convert "
                               "the checkpoint from its GPTQ or marlin source")
        try:
            return cls(**raw)
        except TypeError as e:
            raise MiniCPMError(f"bad int4 settings {raw!r}: {e}") from None


def fitting_group_sizes(in_features, at_most: int = 128) -> list[int]:
    """The int4 group sizes up to ``at_most`` (multiples of 16, largest first) that divide every one of
    ``in_features`` (the K of each linear of a model)."""
    return [g for g in range(at_most - at_most % 16, 0, -16) if all(k % g == 0 for k in in_features)]


def scale_dtype(dtype) -> np.dtype:
    """Dtype of int4 scales (and zero points) for a model in ``dtype``: float16 for half-precision models
    (GPTQ's own scale dtype, so checkpoint scales are kept exactly), float32 otherwise."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float32 else np.dtype(np.float16)


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """A quantized checkpoint's settings: the spec and how its tensors are stored."""

    spec: QuantSpec
    checkpoint_format: str  # gptq (v1 zero points stored −1), gptq_v2, or marlin (Marlin-packed, no zeros)


def _field(raw: dict, key: str, typ, default: Any) -> Any:
    value = raw.get(key, default)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise MiniCPMError(f"quantization_config.{key} must be {typ.__name__}, got {value!r}")
    return value


def parse_quantization_config(raw: dict, *, default_format: str = "gptq") -> CheckpointQuant:
    """A GPTQ-style ``quantization_config`` (config.json) or ``quantize_config.json`` → settings.

    Raises MiniCPMError naming the field for anything the engine cannot run (other methods, bits ≠ 4,
    a quantized lm_head, bad group sizes).
    """
    method = raw.get("quant_method", "gptq")
    if method not in ("gptq", "marlin", "gptq_marlin"):
        raise MiniCPMError(
            f"quantization_config.quant_method {method!r} is not supported (supported: gptq, marlin; "
            "dequantize it elsewhere or use `python -m checkpoints_convert quantize` on the bf16 model)"
        )
    bits = _field(raw, "bits", int, 4)
    if bits != 4:
        raise MiniCPMError(f"quantization_config.bits = {bits} is not supported: only 4-bit (W4A16) weights")
    if raw.get("lm_head"):
        raise MiniCPMError("quantization_config.lm_head = true is not supported: lm_head must stay unquantized")
    group_size = _field(raw, "group_size", int, 128)
    if group_size != -1 and (group_size <= 0 or group_size % 16):
        raise MiniCPMError(f"quantization_config.group_size = {group_size} is not supported (-1 or a multiple of 16)")
    sym = _field(raw, "sym", bool, True)
    desc_act = _field(raw, "desc_act", bool, False)
    fmt = raw.get("checkpoint_format", "marlin" if method != "gptq" else default_format)
    if fmt not in CHECKPOINT_FORMATS:
        raise MiniCPMError(
            f"quantization_config.checkpoint_format {fmt!r} is not supported (supported: {', '.join(CHECKPOINT_FORMATS)})"
        )
    if fmt == "marlin" and (not sym or desc_act):
        raise MiniCPMError("a marlin checkpoint must be symmetric without act-order (sym=true, desc_act=false)")
    return CheckpointQuant(QuantSpec(group_size=group_size, sym=sym, act_order=desc_act), fmt)


def gptq_config_dict(spec: QuantSpec, checkpoint_format: str = "gptq") -> dict:
    """The ``quantization_config`` a checkpoint written with ``spec`` carries (transformers / AutoGPTQ)."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": spec.group_size,
        "sym": spec.sym,
        "desc_act": spec.act_order,
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
        "damp_percent": 0.01,
        "checkpoint_format": checkpoint_format,
    }


def read_quantize_config(path: str) -> dict | None:
    """``quantize_config.json`` beside an older AutoGPTQ checkpoint, or None."""
    file = os.path.join(path, "quantize_config.json")
    return read_json_object(file) if os.path.isfile(file) else None
