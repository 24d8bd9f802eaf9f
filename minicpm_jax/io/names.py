"""The one map from checkpoint tensor names to engine parameters, for targets (dense and int4) and EAGLE
drafts.

Engine parameters are named by their NNX state path (``("model", "layers", 0, "mlp", "down_proj",
"kernel")``). A checkpoint linear is ``<prefix>.weight [out, in]`` (dense) or ``<prefix>.qweight`` and
friends (int4, :mod:`minicpm_jax.io.int4_checkpoint`); the engine stores linears ``[in, out]`` with q/k/v
and gate/up fused along ``out``, so one engine linear comes from one fused or several split checkpoint
linears, whichever the checkpoint holds.
"""

from __future__ import annotations

import dataclasses

from minicpm_jax.config import DraftSpec, ModelConfig

ParamPath = tuple  # an NNX state path
# Buffers some exporters save and the engine recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Linear:
    """One engine linear and the checkpoint linears it is fused from.

    path: the module's state path (its parameters are ``path + ("kernel",)`` dense, or ``path +
    ("qweight", ...)`` int4); prefixes / widths: the checkpoint linears' name prefixes and output widths;
    in_features: K; quantizable: whether an int4 checkpoint stores it in int4 (the decoder linears and a
    draft's ``fc``; heads never are).
    """

    path: ParamPath
    prefixes: tuple[str, ...]
    widths: tuple[int, ...]
    in_features: int
    quantizable: bool = True

    @property
    def weight_names(self) -> tuple[str, ...]:
        return tuple(p + ".weight" for p in self.prefixes)

    @property
    def weight_shapes(self) -> tuple[tuple[int, int], ...]:
        """The dense checkpoint shapes, ``[out, in]`` each."""
        return tuple((w, self.in_features) for w in self.widths)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A parameter read as it is stored (embeddings, norms, biases, index tables).

    optional: a missing tensor is filled with zeros (a draft's ``fc.bias``); integer: read as int32.
    """

    path: ParamPath
    name: str
    shape: tuple[int, ...]
    optional: bool = False
    integer: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointMap:
    """Every parameter of a model and the checkpoint tensors behind it; ``tolerated``: names a checkpoint
    may hold that the engine does not read (a tied head's copy, a draft's copy of the target embedding)."""

    linears: tuple[Linear, ...]
    tensors: tuple[Tensor, ...]
    tolerated: frozenset[str] = frozenset()

    def linear(self, path: ParamPath) -> Linear:
        return next(lin for lin in self.linears if lin.path == path)

    def is_tolerated(self, name: str) -> bool:
        return name in self.tolerated or name.endswith(IGNORED_SUFFIXES)


# The decoder linears that int4 checkpoints quantize, as (module, linear) under a layer.
DECODER_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def split_linears(config: ModelConfig) -> dict[tuple[str, str], tuple[tuple[str, int], ...]]:
    """``{(module, fused linear): ((checkpoint linear, width), ...)}``: how the Hugging Face checkpoints
    split each engine linear of a decoder layer."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_heads * d, config.num_kv_heads * d
    return {
        ("self_attn", "qkv_proj"): (("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)),
        ("self_attn", "o_proj"): (("o_proj", h),),
        ("mlp", "gate_up_proj"): (("gate_proj", i), ("up_proj", i)),
        ("mlp", "down_proj"): (("down_proj", h),),
    }


def decoder_layer_linears(config: ModelConfig, prefix: str, path: ParamPath, names: set[str], *,
                          attention_in: int | None = None) -> list[Linear]:
    """The four linears of a decoder layer under checkpoint ``prefix`` (e.g. ``model.layers.3.``) and
    state ``path``; q/k/v and gate/up fused or split as ``names`` has them (fused iff the fused name is
    there, as ``.weight`` or ``.qweight``). attention_in: q/k/v input width (default hidden_size)."""
    h, i, nq = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim
    in_features = {"qkv_proj": attention_in or h, "o_proj": nq, "gate_up_proj": h, "down_proj": i}
    out = []
    for (module, linear), parts in split_linears(config).items():
        fused = f"{prefix}{module}.{linear}"
        if len(parts) > 1 and (fused + ".weight" in names or fused + ".qweight" in names):
            prefixes, widths = (fused,), (sum(n for _, n in parts),)
        else:
            prefixes = tuple(f"{prefix}{module}.{name}" for name, _ in parts)
            widths = tuple(n for _, n in parts)
        out.append(Linear(path + (module, linear), prefixes, widths, in_features[linear]))
    return out


def model_map(config: ModelConfig, names: set[str]) -> CheckpointMap:
    """The map of :class:`~minicpm_jax.model.causal_lm.MiniCPMForCausalLM` (Hugging Face names)."""
    h = config.hidden_size
    linears: list[Linear] = []
    tensors = [Tensor(("model", "embed_tokens", "embedding"), "model.embed_tokens.weight", (config.vocab_size, h))]
    for layer in range(config.num_layers):
        pre, path = f"model.layers.{layer}.", ("model", "layers", layer)
        tensors += [Tensor(path + ("input_layernorm", "weight"), pre + "input_layernorm.weight", (h,)),
                    Tensor(path + ("post_attention_layernorm", "weight"), pre + "post_attention_layernorm.weight", (h,))]
        linears += decoder_layer_linears(config, pre, path, names)
    tensors.append(Tensor(("model", "norm", "weight"), "model.norm.weight", (h,)))
    if not config.tied_head:
        linears.append(Linear(("lm_head",), ("lm_head",), (config.vocab_size,), h, quantizable=False))
    return CheckpointMap(tuple(linears), tuple(tensors),
                         frozenset({"lm_head.weight"} if config.tied_head else ()))


def draft_layer_prefix(kind: str) -> str:
    """Where a draft's decoder layer lives in the engine's names: ``midlayer.`` (EAGLE-3; ``layers.0.``
    EAGLE-3 checkpoints are renamed on reading) or ``layers.0.``."""
    return "midlayer." if kind == "eagle3" else "layers.0."


def draft_map(spec: DraftSpec, names: set[str]) -> CheckpointMap:
    """The map of :class:`~minicpm_jax.model.draft.EagleDraft` in CPM.cu / SafeAILab names (other layouts
    are renamed first: :func:`minicpm_jax.io.draft.engine_draft_names`)."""
    cfg, kind = spec.layer, spec.kind
    h = cfg.hidden_size
    pre = draft_layer_prefix(kind)
    linears = [Linear(("fc",), ("fc",), (h,), spec.fc_in_features)]
    linears += decoder_layer_linears(cfg, pre, (), names, attention_in=spec.attention_in_features)
    tensors = [Tensor(("post_attention_layernorm", "weight"), pre + "post_attention_layernorm.weight", (h,))]
    if kind == "eagle3":
        tensors += [Tensor(("input_layernorm", "weight"), pre + "input_layernorm.weight", (h,)),
                    Tensor(("hidden_norm", "weight"), pre + "hidden_norm.weight", (h,)),
                    Tensor(("norm", "weight"), "norm.weight", (h,)),
                    Tensor(("d2t",), "d2t", (spec.draft_vocab,), integer=True)]
        linears.append(Linear(("lm_head",), ("lm_head",), (spec.draft_vocab,), h, quantizable=False))
    else:
        tensors.append(Tensor(("fc_bias",), "fc.bias", (h,), optional=True))
    if kind == "minicpm":
        tensors += [Tensor(("input_norm1", "weight"), "input_norm1.weight", (h,)),
                    Tensor(("input_norm2", "weight"), "input_norm2.weight", (h,)),
                    Tensor(("input_layernorm", "weight"), pre + "input_layernorm.weight", (h,))]
    # The embedding is the target's; t2d is implied by d2t. vLLM's MiniCPM EAGLE (EagleMiniCPMModel)
    # builds a final ``norm`` its forward never applies (the draft's logits are lm_head(h / scale_width)),
    # so a vLLM-format draft's norm.weight is read past.
    tolerated = {"embed_tokens.weight", "t2d"} | ({"norm.weight"} if kind == "minicpm" else set())
    return CheckpointMap(tuple(linears), tuple(tensors), frozenset(tolerated))


def resolve_tied_head(config: ModelConfig, names: set[str]) -> ModelConfig:
    """Fixes an unstated ``tie_word_embeddings`` by whether the checkpoint has ``lm_head.weight``."""
    if config.tie_word_embeddings is None:
        return dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in names)
    return config
