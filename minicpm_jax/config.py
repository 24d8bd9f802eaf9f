"""Typed configuration read from a checkpoint's ``config.json``: the model (with its RoPE and InfLLM-v2
settings) and an EAGLE draft's shape.

Two model types are accepted: ``minicpm`` (MiniCPM / MiniCPM4 / MiniCPM4.1, with the muP-style
scalings) and ``llama`` (the same network with neutral scalings). Everything is frozen and hashable so
a config can sit in a jit-static place (an NNX graphdef).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.rope_config import RopeConfig, context_limit, minicpm4_yarn, parse_rope

SUPPORTED_MODEL_TYPES = ("minicpm", "llama")


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """InfLLM-v2 ``sparse_config`` (used by the sparse-attention path; kept here so it is parsed once)."""

    kernel_size: int = 32
    kernel_stride: int = 16
    init_blocks: int = 1
    block_size: int = 64
    window_size: int = 2048
    topk: int = 64
    use_nope: bool = False
    dense_len: int = 8192  # dense below this many tokens; <= 0 (MiniCPM's -1): always sparse

    @property
    def always_sparse(self) -> bool:
        """``dense_len <= 0``: every step is sparse (MiniCPM's README ``-1``; CPM.cu's ``--sparse-switch 0``)."""
        return self.dense_len <= 0

    @property
    def local_blocks(self) -> int:
        """Blocks of the sliding window before the query's own block (HF: ``window_size // block_size``)."""
        return self.window_size // self.block_size

    @property
    def num_selected(self) -> int:
        """Blocks each (query, KV head) attends to at most: ``topk`` plus the local window (HF counts the
        init and local blocks inside this budget by scoring them +inf)."""
        return self.topk + self.local_blocks

    @property
    def kernel_size2(self) -> int:
        """Window of the coarse (LSE) compression: 4x ``kernel_size``."""
        return 4 * self.kernel_size

    @property
    def kernel_stride2(self) -> int:
        """Stride of the coarse (LSE) compression: 4x ``kernel_stride``."""
        return 4 * self.kernel_stride

    @property
    def pool_ratio(self) -> int:
        """Fine compressed keys per block (4 for MiniCPM4: block 64 / stride 16)."""
        return self.block_size // self.kernel_stride

    def check(self) -> "SparseConfig":
        """Raises MiniCPMError unless the block-selection geometry is one the kernels implement."""
        s = self
        if min(s.kernel_size, s.kernel_stride, s.block_size, s.topk) < 1:
            raise MiniCPMError(
                "sparse_config: kernel_size, kernel_stride, block_size and topk must be >= 1, got "
                f"{s.kernel_size}, {s.kernel_stride}, {s.block_size}, {s.topk}")
        if s.kernel_size != 2 * s.kernel_stride or s.block_size % s.kernel_stride:
            raise MiniCPMError(
                "sparse_config: InfLLM-v2 needs kernel_size == 2 * kernel_stride and block_size a multiple of "
                f"kernel_stride (MiniCPM4: 32, 16, 64); got kernel_size={s.kernel_size}, "
                f"kernel_stride={s.kernel_stride}, block_size={s.block_size}")
        return s


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The network's hyper-parameters.

    MiniCPM math: ``x = E[ids]*scale_emb``; each residual branch is scaled by
    ``scale_depth/sqrt(num_layers)``; ``logits = lm_head(norm(x) / (hidden_size/dim_model_base))``.
    A Llama checkpoint is the case ``scale_emb=1, scale_depth=sqrt(L), dim_model_base=hidden_size``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    scale_emb: float
    scale_depth: float
    dim_model_base: float
    tie_word_embeddings: bool | None  # None: not stated; the weight loader decides by the lm_head tensor
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sparse: SparseConfig | None = None
    quantization_json: str | None = None  # raw ``quantization_config``, parsed by the int4 path

    @property
    def residual_scale(self) -> float:
        """Multiplier of every residual branch: scale_depth / sqrt(num_layers)."""
        return self.scale_depth / math.sqrt(self.num_layers)

    @property
    def logit_scale(self) -> float:
        """Multiplier applied to the final normed hidden state before lm_head."""
        return self.dim_model_base / self.hidden_size

    @property
    def tied_head(self) -> bool:
        """Whether lm_head shares the embedding matrix (an unstated choice counts as tied)."""
        return self.tie_word_embeddings is not False

    @property
    def quantization(self) -> dict | None:
        return None if self.quantization_json is None else json.loads(self.quantization_json)

    @property
    def num_params(self) -> int:
        """Parameter count of the dense network (embedding counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tied_head else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @property
    def context_limit(self) -> int:
        """The longest sequence its positions support (:func:`minicpm_jax.rope_config.context_limit`)."""
        return context_limit(self.rope, self.max_position_embeddings)

    def with_minicpm4_yarn(self) -> "ModelConfig":
        """This config with MiniCPM4's validated 128K LongRoPE factors (CPM.cu's ``--minicpm4-yarn``)."""
        orig = self.rope.original_max_position_embeddings or self.max_position_embeddings
        return dataclasses.replace(self, rope=minicpm4_yarn(self.rope, self.head_dim, orig))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a parsed ``config.json``; raises MiniCPMError naming a bad field."""
        return _parse(dict(raw))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads ``<path>/config.json`` (or ``path`` itself if it is a file)."""
        return cls.from_dict(read_config_json(path))

    def to_hf_dict(self) -> dict:
        """A Hugging Face style ``config.json`` dict that ``from_dict`` reads back to an equal config."""
        rope = self.rope
        rope_scaling = rope.to_hf()
        arch = "MiniCPMForCausalLM" if self.model_type == "minicpm" else "LlamaForCausalLM"
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": rope.theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tied_head,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "minicpm":
            out.update(scale_emb=self.scale_emb, scale_depth=self.scale_depth, dim_model_base=self.dim_model_base)
        if self.sparse is not None:
            out["sparse_config"] = dataclasses.asdict(self.sparse)
        if self.quantization_json is not None:
            out["quantization_config"] = json.loads(self.quantization_json)
        return out


def read_config_json(path: str | os.PathLike) -> dict:
    """Loads ``config.json`` from a model directory with a clear error when it is absent or broken."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(path):
        raise MiniCPMError(f"model path {path!r} does not exist; pass a Hugging Face model directory")
    if not os.path.isfile(file):
        raise MiniCPMError(
            f"no config.json in {path!r}; a model directory needs config.json and *.safetensors "
            "(convert other formats with `python -m checkpoints_convert`)"
        )
    return read_json_object(file)


def read_json_object(file: str) -> dict:
    """A JSON file holding an object; MiniCPMError naming the file when unreadable or not an object."""
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise MiniCPMError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise MiniCPMError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _need(raw: dict, key: str, typ: type | tuple[type, ...], default: Any = dataclasses.MISSING) -> Any:
    if key not in raw or raw[key] is None:
        if default is dataclasses.MISSING:
            raise MiniCPMError(f"config.json: required field {key!r} is missing")
        return default
    value = raw[key]
    ok_types = typ if isinstance(typ, tuple) else (typ,)
    if isinstance(value, bool) and bool not in ok_types:
        raise MiniCPMError(f"config.json: field {key!r} must be {_names(ok_types)}, got {value!r}")
    if float in ok_types and isinstance(value, int):
        value = float(value)
    if not isinstance(value, ok_types):
        raise MiniCPMError(f"config.json: field {key!r} must be {_names(ok_types)}, got {value!r}")
    return value


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def _positive(key: str, value: int | float) -> int | float:
    if value <= 0:
        raise MiniCPMError(f"config.json: field {key!r} must be positive, got {value!r}")
    return value


def _parse_sparse(raw: dict) -> SparseConfig | None:
    sc = raw.get("sparse_config")
    if sc is None:
        return None
    if not isinstance(sc, dict):
        raise MiniCPMError(f"config.json: field 'sparse_config' must be an object, got {sc!r}")
    kw = {}
    for field in dataclasses.fields(SparseConfig):
        if field.name in sc:
            val = sc[field.name]
            want = bool if field.type in ("bool", bool) else int
            low = -1 if field.name == "dense_len" else 0  # dense_len -1: always sparse (MiniCPM's README)
            if want is int and (not isinstance(val, int) or isinstance(val, bool) or val < low):
                raise MiniCPMError(f"config.json: sparse_config.{field.name} must be an integer >= {low}, got {val!r}")
            if want is bool and not isinstance(val, bool):
                raise MiniCPMError(f"config.json: sparse_config.{field.name} must be true or false, got {val!r}")
            kw[field.name] = val
    return SparseConfig(**kw)


def _token_ids(raw: dict, key: str) -> tuple[int, ...]:
    val = raw.get(key)
    if val is None:
        return ()
    vals = val if isinstance(val, list) else [val]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise MiniCPMError(f"config.json: field {key!r} must be a token id or a list of token ids, got {val!r}")
    return tuple(dict.fromkeys(vals))


def _parse(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise MiniCPMError(
            f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise MiniCPMError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise MiniCPMError(f"config.json: {flag}=true is not supported (MiniCPM and Llama use no biases)")

    hidden = _positive("hidden_size", _need(raw, "hidden_size", int))
    heads = _positive("num_attention_heads", _need(raw, "num_attention_heads", int))
    kv_heads = _positive("num_key_value_heads", _need(raw, "num_key_value_heads", int, heads))
    if heads % kv_heads:
        raise MiniCPMError(
            f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = raw.get("head_dim") or raw.get("kv_channels") or hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise MiniCPMError(f"config.json: field 'head_dim' must be a positive even integer, got {head_dim!r}")
    layers = _positive("num_hidden_layers", _need(raw, "num_hidden_layers", int))

    if model_type == "minicpm":
        # Defaults are those of the Hugging Face MiniCPMConfig class.
        scale_emb = _need(raw, "scale_emb", float, 1.0)
        scale_depth = _need(raw, "scale_depth", float, 1.0)
        dim_model_base = _need(raw, "dim_model_base", float, 1.0)
        tie_default = None  # the remote-code MiniCPM configs disagree; decided by the checkpoint
    else:
        scale_emb, scale_depth, dim_model_base = 1.0, math.sqrt(layers), float(hidden)
        tie_default = False
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise MiniCPMError(f"config.json: field 'quantization_config' must be an object, got {quant!r}")

    return ModelConfig(
        model_type=model_type,
        vocab_size=_positive("vocab_size", _need(raw, "vocab_size", int)),
        hidden_size=hidden,
        intermediate_size=_positive("intermediate_size", _need(raw, "intermediate_size", int)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive("rms_norm_eps", _need(raw, "rms_norm_eps", float, 1e-6)),
        max_position_embeddings=_positive("max_position_embeddings", _need(raw, "max_position_embeddings", int, 4096)),
        rope=parse_rope(raw, head_dim),
        scale_emb=_positive("scale_emb", scale_emb),
        scale_depth=scale_depth,
        dim_model_base=_positive("dim_model_base", dim_model_base),
        tie_word_embeddings=_need(raw, "tie_word_embeddings", bool, tie_default),
        bos_token_id=(_token_ids(raw, "bos_token_id") or (None,))[0],
        eos_token_ids=_token_ids(raw, "eos_token_id"),
        pad_token_id=(_token_ids(raw, "pad_token_id") or (None,))[0],
        sparse=_parse_sparse(raw),
        quantization_json=None if quant is None else json.dumps(quant, sort_keys=True),
    )


# ------------------------------------------------------------------------------------------ EAGLE drafts
DRAFT_KINDS = ("minicpm", "llama", "eagle3")


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """Shape of an EAGLE draft.

    kind: ``minicpm`` (MiniCPM4 EAGLE as CPM.cu runs it), ``llama`` (SafeAILab EAGLE-1/2) or ``eagle3``
    (see :mod:`minicpm_jax.model.draft`). layer: the decoder layer's hyper-parameters (``num_layers`` 1;
    hidden size, vocabulary and RoPE of the target). residual_scale: multiplier of both residual branches.
    capture: target layers whose input residual stream is the feature (EAGLE-3), empty = the target's
    final-normed hidden state. draft_vocab: V_d (EAGLE-3).
    """

    kind: str
    layer: ModelConfig
    residual_scale: float
    capture: tuple[int, ...] = ()
    draft_vocab: int = 0

    @property
    def feature_size(self) -> int:
        """Width of the target feature the draft reads."""
        return self.layer.hidden_size * max(1, len(self.capture))

    @property
    def fc_in_features(self) -> int:
        """Input width of ``fc``: the feature, plus the token embedding for EAGLE-1/2."""
        return self.feature_size + (0 if self.kind == "eagle3" else self.layer.hidden_size)

    @property
    def attention_in_features(self) -> int:
        """Input width of the layer's q/k/v: ``[embedding; hidden]`` for EAGLE-3, else the hidden size."""
        return 2 * self.layer.hidden_size if self.kind == "eagle3" else self.layer.hidden_size

    @classmethod
    def for_target(cls, target: ModelConfig, kind: str | None = None, draft_vocab: int | None = None,
                   **layer_overrides) -> "DraftSpec":
        """A draft shaped like one target layer (``kind`` default: ``minicpm`` for MiniCPM targets;
        ``draft_vocab`` for EAGLE-3, default the target vocabulary)."""
        kind = kind or ("minicpm" if target.model_type.startswith("minicpm") else "llama")
        if kind not in DRAFT_KINDS:
            raise MiniCPMError(f"draft kind must be one of {', '.join(DRAFT_KINDS)}, got {kind!r}")
        layer = dataclasses.replace(target, num_layers=1, sparse=None, quantization_json=None, **layer_overrides)
        scale = target.scale_depth / math.sqrt(target.num_layers + 1) if kind == "minicpm" else 1.0
        if kind != "eagle3":
            return cls(kind, layer, scale)
        n = target.num_layers
        capture = (min(2, n - 1), n // 2, max(n - 3, 0))
        return cls(kind, layer, 1.0, capture, draft_vocab or target.vocab_size)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], target: ModelConfig, kind: str,
                    head_rows: int | None = None) -> "DraftSpec":
        """The draft of ``kind`` for ``target`` from the draft's own ``config.json`` (``raw``, may be empty):
        head counts, head_dim and MLP width from it (default: the target's); its hidden size (and, for
        EAGLE-1/2, vocabulary) must match the target's. EAGLE-3's draft vocabulary: ``draft_vocab_size``,
        else ``head_rows`` (its lm_head's rows), else the target's. A MiniCPM draft with vLLM's
        ``mup_denominator`` scales its residuals by ``scale_depth / sqrt(mup_denominator)``."""
        keys = ("hidden_size",) if kind == "eagle3" else ("hidden_size", "vocab_size")
        for key in keys:
            if key in raw and raw[key] != getattr(target, key):
                raise MiniCPMError(f"draft config {key} = {raw[key]} does not match the target's {getattr(target, key)}")
        overrides = {}
        for key, field in (("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads"),
                           ("intermediate_size", "intermediate_size"), ("head_dim", "head_dim")):
            if isinstance(raw.get(key), int):
                overrides[field] = raw[key]
        if "num_attention_heads" in raw and "head_dim" not in raw:
            overrides["head_dim"] = target.hidden_size // raw["num_attention_heads"]
        if "num_attention_heads" in raw and "num_key_value_heads" not in raw:
            overrides["num_kv_heads"] = raw["num_attention_heads"]
        draft_vocab = None
        if kind == "eagle3":
            draft_vocab = raw.get("draft_vocab_size") or head_rows or target.vocab_size
        spec = cls.for_target(target, kind, draft_vocab=draft_vocab, **overrides)
        # EAGLE-3 drafts may name their feature layers (vLLM and SpecForge read this key, top level or
        # under eagle_config); each is the index of a target layer whose *input* residual stream is taken.
        aux = raw.get("eagle_aux_hidden_state_layer_ids",
                      (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        if kind == "eagle3" and aux is not None:
            if (not isinstance(aux, list) or len(aux) != 3
                    or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in aux)):
                raise MiniCPMError(f"draft config eagle_aux_hidden_state_layer_ids must be 3 layer indices in "
                                   f"[0, {target.num_layers}), got {aux!r}")
            spec = dataclasses.replace(spec, capture=tuple(aux))
        mup = raw.get("mup_denominator")
        if kind == "minicpm" and isinstance(mup, (int, float)) and mup > 0:
            # vLLM's EagleMiniCPM scales the residuals by scale_depth / sqrt(mup_denominator).
            scale_depth = raw.get("scale_depth", target.scale_depth)
            spec = dataclasses.replace(spec, residual_scale=scale_depth / math.sqrt(mup))
        return spec

    def to_config(self) -> dict:
        """The ``config.json`` a draft of this shape is saved with (read back by :meth:`from_config`)."""
        cfg = self.layer
        out = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_heads,
               "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
               "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1}
        if self.kind == "eagle3":
            out["draft_vocab_size"] = self.draft_vocab
        return out
