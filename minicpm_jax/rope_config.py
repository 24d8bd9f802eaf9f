"""Rotary-embedding settings of a checkpoint (``rope_scaling`` / ``rope_parameters`` in ``config.json``),
the context length they support, and MiniCPM4's validated 128K LongRoPE factors (``--minicpm4_yarn``).

The frequencies themselves are computed in :mod:`minicpm_jax.model.rope`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minicpm_jax.errors import MiniCPMError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")

# The LongRoPE factors MiniCPM's README gives for 128K contexts ("validated up to 131,072 tokens"); CPM.cu's
# --minicpm4-yarn writes them as both short_factor and long_factor (cpmcu/common/utils.py
# apply_minicpm4_yarn_config). MiniCPM4's shipped config.json has a list that differs after index 20.
MINICPM4_YARN_FACTORS = (
    0.9977997200264581, 1.014658295992452, 1.0349680404997148, 1.059429246056193,
    1.0888815016813513, 1.1243301355211495, 1.166977103606075, 1.2182568066927284,
    1.2798772354275727, 1.3538666751582975, 1.4426259039919596, 1.5489853358570191,
    1.6762658237220625, 1.8283407612492941, 2.0096956085876183, 2.225478927469756,
    2.481536379650452, 2.784415934557119, 3.1413289096347365, 3.560047844772632,
    4.048719380066383, 4.752651957515948, 5.590913044973868, 6.584005926629993,
    7.7532214876576155, 9.119754865903639, 10.704443927019176, 12.524994176518703,
    14.59739595363613, 16.93214476166354, 19.53823297353041, 22.417131025031697,
    25.568260840911098, 28.991144156566317, 32.68408069090375, 36.65174474170465,
    40.90396065611201, 45.4664008671033, 50.37147343433591, 55.6804490772103,
    61.470816952306556, 67.8622707390618, 75.00516023410414, 83.11898235973767,
    92.50044360202462, 103.57086856690864, 116.9492274587385, 118.16074567836519,
    119.18497548708795, 120.04810876261652, 120.77352815196981, 121.38182790207875,
    121.89094985353891, 122.31638758099915, 122.6714244963338, 122.9673822552567,
    123.21386397019609, 123.41898278254268, 123.58957065488238, 123.73136519024158,
    123.84917421274221, 123.94701903496814, 124.02825801299717, 124.09569231686116,
)
# The context MiniCPM4's LongRoPE is validated for (MiniCPM README, InfLLM-v2's 128K target).
LONGROPE_CONTEXT = 131072


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    factor: linear / llama3 / yarn context scale; original_max_position_embeddings: llama3 / longrope /
    yarn pre-training context; short/long_factor: longrope, head_dim/2 values each; beta_fast, beta_slow,
    mscale, mscale_all_dim, attention_factor, truncate: YaRN's ramp and amplitude (as in the Hugging Face
    ``_compute_yarn_parameters``; ``attention_factor`` None = derived from ``factor`` and the mscales).
    """

    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def to_hf(self) -> dict[str, Any] | None:
        """The ``rope_scaling`` dict :func:`parse_rope` reads back to an equal config (None for default)."""
        if self.kind == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.kind}
        if self.kind in ("linear", "llama3", "yarn"):
            out["factor"] = self.factor
        if self.kind in ("llama3", "longrope", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.kind == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.kind == "longrope":
            out.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor))
        if self.kind == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


def _number(scaling: dict, key: str, default: float | None, kind: str, positive: bool = True) -> float | None:
    val = scaling.get(key, default)
    if val is None and default is None:
        return None
    if not isinstance(val, (int, float)) or isinstance(val, bool) or (positive and val <= 0):
        raise MiniCPMError(f"config.json: rope_scaling.{key} must be a positive number for {kind!r}, got {val!r}")
    return float(val)


def parse_rope(raw: dict, head_dim: int) -> RopeConfig:
    """The :class:`RopeConfig` of a parsed ``config.json``; MiniCPMError naming a bad field."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(scaling, dict):
        raise MiniCPMError(f"config.json: field 'rope_scaling' must be an object or null, got {scaling!r}")
    theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise MiniCPMError(f"config.json: field 'rope_theta' must be a positive number, got {theta!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise MiniCPMError(
            f"config.json: rope_scaling.rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    orig = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    kw: dict[str, Any] = {"kind": kind, "theta": float(theta)}
    if kind in ("linear", "llama3", "yarn"):
        kw["factor"] = _number(scaling, "factor", None, kind)
        if kw["factor"] is None:
            raise MiniCPMError(f"config.json: rope_scaling.factor must be a positive number for {kind!r}, got None")
    if kind in ("llama3", "longrope") and (not isinstance(orig, int) or orig <= 0):
        raise MiniCPMError(f"config.json: rope_scaling.original_max_position_embeddings is required for {kind!r}")
    if kind == "llama3":
        kw.update(low_freq_factor=_number(scaling, "low_freq_factor", 1.0, kind),
                  high_freq_factor=_number(scaling, "high_freq_factor", 4.0, kind),
                  original_max_position_embeddings=orig)
    if kind == "yarn":
        # As transformers: the pre-training context defaults to max_position_embeddings.
        orig = orig if isinstance(orig, int) and orig > 0 else raw.get("max_position_embeddings", 4096)
        kw.update(original_max_position_embeddings=orig,
                  beta_fast=_number(scaling, "beta_fast", 32.0, kind), beta_slow=_number(scaling, "beta_slow", 1.0, kind),
                  mscale=_number(scaling, "mscale", None, kind, positive=False),
                  mscale_all_dim=_number(scaling, "mscale_all_dim", None, kind, positive=False),
                  attention_factor=_number(scaling, "attention_factor", None, kind),
                  truncate=bool(scaling.get("truncate", True)))
    if kind == "longrope":
        factors = {}
        for name in ("short_factor", "long_factor"):
            vals = scaling.get(name)
            if (
                not isinstance(vals, list)
                or len(vals) != head_dim // 2
                or not all(isinstance(v, (int, float)) and v > 0 for v in vals)
            ):
                raise MiniCPMError(
                    f"config.json: rope_scaling.{name} must be a list of {head_dim // 2} positive numbers (head_dim/2)"
                )
            factors[name] = tuple(float(v) for v in vals)
        kw.update(original_max_position_embeddings=orig, **factors)
    return RopeConfig(**kw)


def minicpm4_yarn(rope: RopeConfig, head_dim: int, original_max_position_embeddings: int) -> RopeConfig:
    """``rope`` with MiniCPM4's validated 128K LongRoPE factors as both short and long factors (CPM.cu's
    ``--minicpm4-yarn``); MiniCPMError unless the model has MiniCPM4's head_dim 128."""
    if head_dim != 2 * len(MINICPM4_YARN_FACTORS):
        raise MiniCPMError(f"--minicpm4_yarn holds MiniCPM4's factors for head_dim {2 * len(MINICPM4_YARN_FACTORS)}; "
                           f"this model has head_dim {head_dim}")
    orig = rope.original_max_position_embeddings if rope.kind == "longrope" else original_max_position_embeddings
    return dataclasses.replace(RopeConfig(kind="longrope", theta=rope.theta), original_max_position_embeddings=orig,
                               short_factor=MINICPM4_YARN_FACTORS, long_factor=MINICPM4_YARN_FACTORS)


def context_limit(rope: RopeConfig, max_position_embeddings: int) -> int:
    """The longest sequence the positions support: ``max_position_embeddings``, or more where the rope
    extends it (linear / llama3 / YaRN: ``factor`` × the pre-training context; MiniCPM's LongRoPE: 131,072,
    the length its README validates)."""
    if rope.kind in ("linear", "llama3", "yarn"):
        base = rope.original_max_position_embeddings or max_position_embeddings
        return max(max_position_embeddings, int(base * rope.factor))
    if rope.kind == "longrope":
        return max(max_position_embeddings, LONGROPE_CONTEXT)
    return max_position_embeddings
