"""EAGLE draft models for speculative decoding, their checkpoints, and FR-Spec vocabulary subsets.

Two draft architectures, both one decoder layer over ``x = fc([embedding; target feature])`` whose output
goes through the *target's* lm_head (no final norm):

* ``minicpm`` — MiniCPM4 EAGLE as CPM.cu runs it: ``x = fc([RMSNorm₁(E[tok]·scale_emb); RMSNorm₂(f)])``,
  a pre-norm MiniCPM layer whose residual branches are scaled by ``scale_depth / sqrt(L_target + 1)``
  (CPM.cu's constant), logits ``lm_head(x · dim_model_base / hidden)``. Tensors: ``fc.weight [H, 2H]``
  (embedding half first), ``fc.bias``, ``input_norm1.weight``, ``input_norm2.weight``, ``layers.0.*``.
* ``llama`` — SafeAILab EAGLE-1/2: ``x = fc([E[tok]; f])`` (with bias), a Llama layer *without* its input
  norm, unscaled residuals. Tensors: ``fc.weight``, ``fc.bias``, ``layers.0.{self_attn,mlp}.*``,
  ``layers.0.post_attention_layernorm.weight``.

``f`` is the target's final-normed hidden state at the previous position (and, inside a draft tree, the
draft's own output for its parent). The draft shares the target's embedding, RoPE and lm_head.

* ``eagle3`` — EAGLE-3 (SafeAILab format): the target feature is the residual stream entering target
  layers ``(2, L//2, L-3)``, concatenated (3H); ``g = fc(features)`` (no bias; the draft's own outputs
  inside a tree skip fc); ``midlayer`` attends over ``[input_layernorm(E[tok]); hidden_norm(g)]`` (q/k/v
  take 2H), residual ``g``, then post-attention norm and MLP; logits ``lm_head(norm(h))`` over a draft
  vocabulary of V_d ids, draft id d meaning target id ``d + d2t[d]``. Tensors: ``fc.weight [H, 3H]``,
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight [V_d, H]``, ``d2t``, ``t2d``. Residuals unscaled.

FR-Spec (:func:`read_frspec`): the draft's top-k runs over a frequency-ranked vocabulary subset; the
draft head is those rows of the target lm_head.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm_jax.attention import Attention, TreeInputs
from minicpm_jax.cache import KVCache
from minicpm_jax.config import ModelConfig, read_config_json
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.layers import MLP, Linear, RMSNorm, make_linear
from minicpm_jax.quant import CheckpointQuant, QuantSpec, parse_quantization_config, read_quantize_config

DRAFT_KINDS = ("minicpm", "llama", "eagle3")


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """Shape of an EAGLE draft.

    kind: ``minicpm``, ``llama`` or ``eagle3`` (see the module doc). layer: the decoder layer's
    hyper-parameters (``num_layers`` 1; hidden size, vocabulary and RoPE of the target). residual_scale:
    multiplier of both residual branches. capture: target layers whose input residual stream is the
    feature (EAGLE-3), empty = the target's final-normed hidden state. draft_vocab: V_d (EAGLE-3).
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


class EagleDraft(nnx.Module):
    """One-layer EAGLE draft (``minicpm`` or ``llama`` kind) over its own one-layer :class:`KVCache`.

    Args:
      spec: the draft's shape (:meth:`DraftSpec.for_target`).
      max_length: the target's cache length (RoPE factors follow it, as in the target).
      attention_impl: ``xla`` or ``pallas`` (the draft's tree attention).
      rngs: random initialisation (tests, benchmarks); None gives zeros, to be loaded.
      quant: int4 ``fc`` and layer linears (CPM.cu's quantized drafts); norms and an EAGLE-3 head stay dense.
    """

    def __init__(self, spec: DraftSpec, *, max_length: int, attention_impl: str, dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None, quant: QuantSpec | None = None):
        cfg = spec.layer
        h = cfg.hidden_size
        self.spec = spec
        self.dtype = jnp.dtype(dtype)
        eps = cfg.rms_norm_eps
        eagle3 = spec.kind == "eagle3"
        self.quant = quant
        linear = dict(impl=attention_impl, rngs=rngs, dtype=dtype)
        self.fc = make_linear(spec.feature_size + (0 if eagle3 else h), h, quant, **linear)
        if eagle3:
            self.input_layernorm = RMSNorm(h, eps, dtype=dtype)
            self.hidden_norm = RMSNorm(h, eps, dtype=dtype)
            self.norm = RMSNorm(h, eps, dtype=dtype)
            self.lm_head = Linear(h, spec.draft_vocab, rngs=rngs, dtype=dtype)
            self.d2t = nnx.Variable(jnp.zeros((spec.draft_vocab,), jnp.int32))
        else:
            self.fc_bias = nnx.Param(jnp.zeros((h,), dtype))
        if spec.kind == "minicpm":
            self.input_norm1 = RMSNorm(h, eps, dtype=dtype)
            self.input_norm2 = RMSNorm(h, eps, dtype=dtype)
            self.input_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.self_attn = Attention(cfg, 0, max_length=max_length, attention_impl=attention_impl, rngs=rngs, dtype=dtype,
                                   quant=quant, in_features=2 * h if eagle3 else h)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, rngs=rngs, dtype=dtype, quant=quant, impl=attention_impl)

    @property
    def own_head(self) -> bool:
        """Whether the draft has its own (reduced-vocabulary) head (EAGLE-3) instead of the target's."""
        return self.spec.kind == "eagle3"

    def logits(self, hidden: jax.Array) -> jax.Array:
        """EAGLE-3 draft logits ``f32[..., V_d]`` (draft ids; :meth:`target_ids` maps them)."""
        h = self.norm(hidden)
        return jnp.dot(h, self.lm_head.kernel[...].astype(h.dtype), preferred_element_type=jnp.float32)

    def target_ids(self) -> jax.Array:
        """``int32[V_d]``: the target token of each EAGLE-3 draft id (``d + d2t[d]``)."""
        return jnp.arange(self.spec.draft_vocab, dtype=jnp.int32) + self.d2t[...]

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty one-layer cache for ``max_length`` draft positions."""
        return KVCache.create(self.spec.layer, batch_size, max_length, self.dtype)

    def __call__(self, embedded: jax.Array, features: jax.Array, positions: jax.Array, valid: jax.Array,
                 cache: KVCache, tree: TreeInputs | None = None, from_target: bool = True) -> tuple[jax.Array, KVCache]:
        """One draft step over T tokens.

        embedded ``[B, T, H]``: the target's scaled token embeddings; features: the feature each token
        is paired with — the target's (``[B, T, feature_size]``, ``from_target``) or the draft's own
        output (``[B, T, H]``; EAGLE-3 then skips fc); positions ``int32[B, T]`` (RoPE); valid ``bool[B, T]``.
        Without ``tree`` the tokens are appended causally at the cache length (prefill; the length
        advances by the valid count); with it they are tree tokens (:class:`TreeInputs`; length unchanged).
        Returns the draft hidden states ``[B, T, H]`` (before the lm_head, no final norm) and the cache.
        """
        dt = self.dtype
        e, f = embedded.astype(dt), features.astype(dt)
        if self.spec.kind == "eagle3":
            x = self.fc(f) if from_target else f
            a = jnp.concatenate([self.input_layernorm(e), self.hidden_norm(x)], axis=-1)
        else:
            if self.spec.kind == "minicpm":
                e, f = self.input_norm1(e), self.input_norm2(f)
            x = self.fc(jnp.concatenate([e, f], axis=-1)) + self.fc_bias[...].astype(dt)
            a = self.input_layernorm(x) if self.spec.kind == "minicpm" else x
        kv_lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
        attn, cache = self.self_attn(a, positions, valid, cache, kv_lengths, "dense", tree)
        s = jnp.asarray(self.spec.residual_scale, dt)
        x = x + attn * s
        x = x + self.mlp(self.post_attention_layernorm(x)) * s
        if tree is None:
            cache = dataclasses.replace(cache, lengths=kv_lengths)
        return x, cache


# ------------------------------------------------------------------------------------------- checkpoints


def read_draft_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a draft directory as NumPy arrays (bf16 kept as ``ml_dtypes.bfloat16``):
    ``*.safetensors``, else ``pytorch_model.bin`` (needs torch)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors: dict[str, np.ndarray] = {}
    if files:
        for f in files:
            try:
                with safe_open(os.path.join(path, f), framework="flax") as h:
                    tensors.update({k: np.asarray(h.get_tensor(k)) for k in h.keys()})
            except (SafetensorError, OSError, ValueError) as e:
                raise MiniCPMError(f"{os.path.join(path, f)} is not a readable safetensors file ({e})") from None
        return tensors
    binary = os.path.join(path, "pytorch_model.bin")
    if not os.path.isfile(binary):
        raise MiniCPMError(f"no *.safetensors or pytorch_model.bin in the draft directory {path!r}")
    try:
        import torch
    except ImportError:
        raise MiniCPMError(f"{binary} is a PyTorch file: install torch to read it, or convert it to safetensors") from None
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise MiniCPMError(f"cannot read {binary}: {e}") from None
    import ml_dtypes

    return {k: v.float().numpy().astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
            for k, v in state.items()}


def from_vllm_names(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], bool]:
    """Renames a vLLM-format MiniCPM EAGLE checkpoint (``model.fc``, ``model.input_norm{1,2}``,
    ``model.eagle_layers.0.*``, ``model.embed_tokens``, ``lm_head``) to CPM.cu's names; returns (tensors,
    whether it was vLLM's). The copies of the target's embedding and lm_head are dropped (the target's
    own are used); drafts of more than one layer are refused."""
    if not any(n.startswith(("model.eagle_layers.", "model.fc.")) for n in tensors):
        return tensors, False
    layers = {n.split(".")[2] for n in tensors if n.startswith("model.eagle_layers.")}
    if layers - {"0"}:
        raise MiniCPMError(f"this draft has {len(layers)} EAGLE layers; only one-layer drafts are supported")
    out = {}
    for name, value in tensors.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        name = name.replace("model.eagle_layers.0.", "layers.0.")
        out[name[len("model."):] if name.startswith("model.") else name] = value
    return out, True


def to_vllm_names(tensors: dict[str, np.ndarray], embed: np.ndarray, lm_head: np.ndarray) -> dict[str, np.ndarray]:
    """CPM.cu-format MiniCPM EAGLE tensors → vLLM's names, with the target's embedding and lm_head."""
    out = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    for name, value in tensors.items():
        out["model." + name.replace("layers.0.", "eagle_layers.0.")] = value
    return out


def draft_kind_of(names: set[str]) -> str:
    """``minicpm``, ``llama`` or ``eagle3`` from a draft checkpoint's tensor names (CPM.cu / SafeAILab
    names, after :func:`from_vllm_names`); a clear error for other checkpoints."""
    if "fc.weight" not in names and "fc.qweight" not in names:
        raise MiniCPMError("not an EAGLE draft checkpoint: it has no fc.weight (or int4 fc.qweight) tensor")
    if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
        return "eagle3"
    return "minicpm" if "input_norm1.weight" in names else "llama"


def _layer_prefix(kind: str) -> str:
    return "midlayer." if kind == "eagle3" else "layers.0."


def _checkpoint_layout(spec: DraftSpec, names: set[str]) -> list[tuple[tuple, tuple[str, ...], tuple[tuple[int, ...], ...]]]:
    """``(param path, checkpoint tensor names, their shapes)`` for every draft parameter; split or fused
    q/k/v and gate/up as the checkpoint has them. Linear tensors are ``[out, in]``."""
    cfg, kind = spec.layer, spec.kind
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    pre = _layer_prefix(kind)
    attn_in = 2 * h if kind == "eagle3" else h
    if pre + "self_attn.qkv_proj.weight" in names:
        qkv = ((pre + "self_attn.qkv_proj.weight",), ((nq + 2 * nkv, attn_in),))
    else:
        qkv = (tuple(pre + f"self_attn.{p}_proj.weight" for p in "qkv"), ((nq, attn_in), (nkv, attn_in), (nkv, attn_in)))
    if pre + "mlp.gate_up_proj.weight" in names:
        gate_up = ((pre + "mlp.gate_up_proj.weight",), ((2 * i, h),))
    else:
        gate_up = ((pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"), ((i, h), (i, h)))
    out = [
        (("fc", "kernel"), ("fc.weight",), ((h, spec.feature_size + (0 if kind == "eagle3" else h)),)),
        (("self_attn", "qkv_proj", "kernel"), *qkv),
        (("self_attn", "o_proj", "kernel"), (pre + "self_attn.o_proj.weight",), ((h, nq),)),
        (("mlp", "gate_up_proj", "kernel"), *gate_up),
        (("mlp", "down_proj", "kernel"), (pre + "mlp.down_proj.weight",), ((h, i),)),
        (("post_attention_layernorm", "weight"), (pre + "post_attention_layernorm.weight",), ((h,),)),
    ]
    if kind == "eagle3":
        out += [
            (("input_layernorm", "weight"), (pre + "input_layernorm.weight",), ((h,),)),
            (("hidden_norm", "weight"), (pre + "hidden_norm.weight",), ((h,),)),
            (("norm", "weight"), ("norm.weight",), ((h,),)),
            (("lm_head", "kernel"), ("lm_head.weight",), ((spec.draft_vocab, h),)),
            (("d2t",), ("d2t",), ((spec.draft_vocab,),)),
        ]
    else:
        out.append((("fc_bias",), ("fc.bias",), ((h,),)))
    if kind == "minicpm":
        out += [(("input_norm1", "weight"), ("input_norm1.weight",), ((h,),)),
                (("input_norm2", "weight"), ("input_norm2.weight",), ((h,),)),
                (("input_layernorm", "weight"), (pre + "input_layernorm.weight",), ((h,),))]
    return out


def _int4_sources(spec: DraftSpec, names: set[str]):
    """The checkpoint linears behind each int4 linear of a quantized draft (``fc`` and the layer's)."""
    from minicpm_jax.weights_int4 import Int4Source, linear_shapes

    cfg, pre = spec.layer, _layer_prefix(spec.kind)
    h = cfg.hidden_size
    out = [Int4Source(("fc",), ("fc",), (h,), spec.feature_size + (0 if spec.kind == "eagle3" else h))]
    for (module, linear), (k, parts) in linear_shapes(cfg).items():
        if module == "self_attn" and linear == "qkv_proj" and spec.kind == "eagle3":
            k = 2 * h
        fused = f"{pre}{module}.{linear}"
        if len(parts) > 1 and fused + ".qweight" in names:
            prefixes, widths = (fused,), (sum(n for _, n in parts),)
        else:
            prefixes, widths = tuple(f"{pre}{module}.{n}" for n, _ in parts), tuple(n for _, n in parts)
        out.append(Int4Source((module, linear), prefixes, widths, k))
    return out


def _draft_quant(path: str, raw: dict, tensors: dict[str, np.ndarray], spec: DraftSpec) -> CheckpointQuant | None:
    """The int4 settings of a quantized draft (``quantization_config`` in its config.json or
    ``quantize_config.json``; Marlin packing recognised from the ``fc.qweight`` shape, as CPM.cu's
    converter keeps the GPTQ config), or None when it is dense."""
    if not any(n.endswith(".qweight") for n in tensors):
        return None
    settings = raw.get("quantization_config") or read_quantize_config(path)
    if settings is None:
        raise MiniCPMError(f"draft {path!r} holds *.qweight tensors but no quantization_config or quantize_config.json")
    ck = parse_quantization_config(settings)
    fc = _int4_sources(spec, set(tensors))[0]
    if ck.checkpoint_format != "marlin" and "fc.qweight" in tensors and \
            tuple(tensors["fc.qweight"].shape) == (fc.in_features // 16, 2 * fc.widths[0]):
        if not ck.spec.sym or ck.spec.act_order:
            raise MiniCPMError("fc.qweight is Marlin-packed, but the config says sym=false or desc_act=true")
        ck = CheckpointQuant(ck.spec, "marlin")
    return ck


def load_draft(path: str, target: ModelConfig, *, max_length: int, attention_impl: str, dtype) -> EagleDraft:
    """Loads an EAGLE draft directory (tensors plus an optional ``config.json``) for ``target``.

    The draft layer's head counts and MLP width come from its ``config.json`` (default: the target's);
    its hidden size (and, for EAGLE-1/2, vocabulary) must match the target's. Missing, unexpected or
    misshapen tensors raise one MiniCPMError listing them.
    """
    if not os.path.isdir(path):
        raise MiniCPMError(f"draft checkpoint directory {path!r} does not exist")
    tensors, _ = from_vllm_names(read_draft_tensors(path))
    names = set(tensors)
    kind = draft_kind_of(names)
    overrides = {}
    raw = read_config_json(path) if os.path.isfile(os.path.join(path, "config.json")) else {}
    keys = ("hidden_size",) if kind == "eagle3" else ("hidden_size", "vocab_size")
    for key in keys:
        if key in raw and raw[key] != getattr(target, key):
            raise MiniCPMError(f"draft config {key} = {raw[key]} does not match the target's {getattr(target, key)}")
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
        draft_vocab = raw.get("draft_vocab_size") or (tensors["lm_head.weight"].shape[0] if "lm_head.weight" in names
                                                      else target.vocab_size)
    spec = DraftSpec.for_target(target, kind, draft_vocab=draft_vocab, **overrides)
    if kind == "minicpm" and isinstance(raw.get("mup_denominator"), (int, float)) and raw["mup_denominator"] > 0:
        # vLLM's EagleMiniCPM scales the residuals by scale_depth / sqrt(mup_denominator).
        scale_depth = raw.get("scale_depth", target.scale_depth)
        spec = dataclasses.replace(spec, residual_scale=scale_depth / math.sqrt(raw["mup_denominator"]))
    layout = _checkpoint_layout(spec, names)
    ck = _draft_quant(path, raw, tensors, spec)
    int4_sources = _int4_sources(spec, names) if ck is not None else []
    if ck is not None:  # the quantized linears come from their int4 tensors, not from dense weights
        quantized = {src.path + ("kernel",) for src in int4_sources}
        layout = [entry for entry in layout if entry[0] not in quantized]
    want = {n: shape for _, ns, shapes in layout for n, shape in zip(ns, shapes)}
    optional = {"fc.bias", "embed_tokens.weight", "t2d"}  # the embedding is the target's; t2d is implied by d2t
    problems = [f"missing tensor {n} (expected shape {list(sh)})" for n, sh in want.items()
                if n not in names and n != "fc.bias"]
    problems += [f"tensor {n} has shape {list(tensors[n].shape)}, expected {list(sh)}"
                 for n, sh in want.items() if n in names and tuple(tensors[n].shape) != sh]
    used = set()
    if ck is not None:
        from minicpm_jax.weights_int4 import check_int4_tensors

        int4_problems, used = check_int4_tensors(int4_sources, ck, lambda n: tuple(tensors[n].shape), names)
        problems += int4_problems
    problems += [f"unexpected tensor {n}" for n in sorted(names - set(want) - optional - used)
                 if not n.endswith("rotary_emb.inv_freq")]
    if kind == "eagle3" and "d2t" in names and not problems:
        mapped = np.arange(spec.draft_vocab) + tensors["d2t"].astype(np.int64)
        if mapped.min() < 0 or mapped.max() >= target.vocab_size:
            problems.append(f"d2t maps draft ids outside the target vocabulary [0, {target.vocab_size})")
    if problems:
        raise MiniCPMError(f"draft checkpoint {path!r} does not match its target:\n  " + "\n  ".join(problems))

    def value(param, ns):
        if param == ("d2t",):
            return jnp.asarray(tensors["d2t"], jnp.int32)
        if param == ("fc_bias",):
            return jnp.asarray(tensors["fc.bias"], dtype) if "fc.bias" in names else jnp.zeros((spec.layer.hidden_size,), dtype)
        parts = [np.asarray(tensors[n], np.float32) for n in ns]
        if param[-1] == "kernel":  # checkpoint [out, in] -> engine [in, out], fused along out
            return jnp.asarray(np.concatenate([p.T for p in parts], axis=1), dtype)
        return jnp.asarray(parts[0], dtype)

    quant = None if ck is None else ck.spec
    draft = nnx.eval_shape(lambda: EagleDraft(spec, max_length=max_length, attention_impl=attention_impl, dtype=dtype,
                                              quant=quant))
    values = {param: value(param, ns) for param, ns, _ in layout}
    if ck is not None:
        from minicpm_jax.weights_int4 import engine_arrays, read_int4_linear

        for src in int4_sources:
            w = read_int4_linear(src, ck, tensors.get)
            for key, array in engine_arrays(w, quant, dtype).items():
                values[src.path + (key,)] = jnp.asarray(array)
    graphdef, state = nnx.split(draft)
    flat = dict(nnx.to_flat_state(state))
    for key, var in flat.items():
        var.set_value(values[key]) if hasattr(var, "set_value") else setattr(var, "value", values[key])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_draft(draft: EagleDraft, path: str) -> None:
    """Writes ``draft`` in CPM.cu / SafeAILab tensor names (``model.safetensors`` + ``config.json``,
    written to a temporary directory and renamed), the format :func:`load_draft` reads."""
    import json

    from safetensors.numpy import save_file

    if os.path.exists(path):
        raise MiniCPMError(f"{path!r} already exists")
    if draft.quant is not None:
        raise MiniCPMError("save_draft writes dense drafts; an int4 draft is kept in its GPTQ / marlin checkpoint")
    spec = draft.spec
    cfg = spec.layer
    flat = {k: np.asarray(v[...]).astype(np.int64 if k == ("d2t",) else np.float32)
            for k, v in nnx.to_flat_state(nnx.state(draft))}
    tensors = {}
    for param, ns, shapes in _checkpoint_layout(spec, {_layer_prefix(spec.kind) + "self_attn.q_proj.weight"}):
        value = flat[param]
        if param[-1] == "kernel":
            rows = np.split(value.T, np.cumsum([sh[0] for sh in shapes])[:-1], axis=0)
            tensors.update({n: np.ascontiguousarray(r) for n, r in zip(ns, rows)})
        else:
            tensors[ns[0]] = value
    config = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1}
    if spec.kind == "eagle3":
        config["draft_vocab_size"] = spec.draft_vocab
    tmp = path.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- FR-Spec


class _ListOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain Python data only (a torch.save'd list of ints needs nothing else)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: an FR-Spec index is a plain list of ids")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("the file holds tensors, not a plain list of token ids")


def _unpickle_torch_save(data: bytes) -> object:
    """The object of a ``torch.save`` file holding plain Python data, read without torch (zip format,
    or the legacy format: magic number, protocol, sys info, then the object)."""
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                raise pickle.UnpicklingError("zip file without data.pkl")
            return _ListOnlyUnpickler(io.BytesIO(z.read(name))).load()
    stream = io.BytesIO(data)
    first = _ListOnlyUnpickler(stream).load()
    if isinstance(first, int) and first == 0x1950A86A20F9469CFC6C:  # torch's legacy magic number
        _ListOnlyUnpickler(stream).load()  # protocol version
        _ListOnlyUnpickler(stream).load()  # sys info
        return _ListOnlyUnpickler(stream).load()
    return first


def read_frspec(path: str, vocab_size: int, subset_size: int | None = None) -> np.ndarray:
    """Token ids of an FR-Spec subset, most frequent first, deduplicated: ``int32[V']``.

    path: a file — CPM.cu's ``freq_{V}.pt`` (a ``torch.save``'d list of ids, read without torch), a
    ``.npy`` array or a text file of one id per line — or a directory holding ``freq_{subset_size}.pt``
    (or ``.npy``). Ids outside ``[0, vocab_size)`` or an empty list raise MiniCPMError.
    """
    if os.path.isdir(path):
        if subset_size is None:
            raise MiniCPMError(f"{path!r} is a directory: give the FR-Spec vocabulary size to pick freq_<size>.pt")
        for ext in (".pt", ".npy"):
            candidate = os.path.join(path, f"freq_{subset_size}{ext}")
            if os.path.isfile(candidate):
                path = candidate
                break
        else:
            raise MiniCPMError(f"no freq_{subset_size}.pt or freq_{subset_size}.npy in {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise MiniCPMError(f"cannot read the FR-Spec index {path!r}: {e}") from None
    try:
        if path.endswith(".npy"):
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        elif path.endswith(".pt"):
            ids = _unpickle_torch_save(data)
        else:
            ids = [int(line) for line in data.decode("utf-8").split()]
        ids = np.asarray(ids).reshape(-1)
    except (pickle.UnpicklingError, EOFError, ValueError, UnicodeDecodeError, zipfile.BadZipFile, TypeError) as e:
        raise MiniCPMError(f"{path!r} is not an FR-Spec index (a list of token ids): {e}") from None
    if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise MiniCPMError(f"{path!r} holds no integer token ids")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise MiniCPMError(f"{path!r} has token ids outside the vocabulary [0, {vocab_size})")
    _, first = np.unique(ids, return_index=True)
    ids = ids[np.sort(first)]  # deduplicated, order kept
    if subset_size is not None:
        ids = ids[:subset_size]
    return ids.astype(np.int32)
