"""Models from checkpoints: :func:`load_model` (Hugging Face dense / GPTQ / marlin-cpmcu directories and
native ones), :func:`load_draft` (EAGLE drafts), int4 ↔ dense conversion of a loaded model, and saving.

The readers in :mod:`minicpm_jax.io` yield ``(param path, array)``; here an abstract model (shapes only,
no memory) is built and filled with them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from minicpm_jax.config import DraftSpec, ModelConfig, SparseConfig, read_config_json
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.policy import resolve_sparse
from minicpm_jax.io import int4_formats
from minicpm_jax.io.draft import (draft_kind_of, draft_quant, engine_draft_names, read_draft_tensors, to_vllm_names,
                                  write_draft)
from minicpm_jax.io.hf import hf_checkpoint_quant, hf_params
from minicpm_jax.io.int4_checkpoint import rtn_arrays
from minicpm_jax.io.names import DECODER_LINEARS, ParamPath, draft_layer_prefix, draft_map, resolve_tied_head
from minicpm_jax.io.native import is_native, native_quant, read_native, write_native
from minicpm_jax.io.params import checkpoint_problems, read_params, report
from minicpm_jax.io.safetensors import ArrayReader, safetensors_files
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.parallel import AXIS, from_layout, param_axes, partition_spec, place, to_layout
from minicpm_jax.quant import QUANT_CHOICES, QuantSpec
from minicpm_jax.rope_config import MINICPM4_YARN_FACTORS


def abstract_model(config: ModelConfig, **model_kwargs) -> MiniCPMForCausalLM:
    """The model with shape-only parameters (no memory), ready to be filled by :func:`fill_model`
    (``model_kwargs``: those of :class:`MiniCPMForCausalLM`)."""
    return nnx.eval_shape(lambda: MiniCPMForCausalLM(config, rngs=None, **model_kwargs))


def param_shapes(model: nnx.Module) -> dict[ParamPath, jax.ShapeDtypeStruct]:
    """``{param path: shape and dtype}`` of every parameter of ``model`` (abstract or not)."""
    return {p: jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def fill_model(model: nnx.Module, params: Iterator[tuple[ParamPath, jax.Array]], *, canonical: bool = True) -> nnx.Module:
    """Replaces the parameters (and variables) of an (abstract) model by the given arrays; every one must
    be given, with its shape. A model split over a mesh takes each array in the checkpoint's order
    (``canonical``; else already in its stored layout) and places it by its logical axes, one at a time."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    mesh = getattr(model, "mesh", None)
    seen = set()
    for path, value in params:
        var = flat[path]
        if mesh is not None:
            axes = param_axes(var)
            if canonical:
                value = to_layout(model.tp, axes, value)
            if tuple(value.shape) == tuple(var.shape):
                value = place(value, NamedSharding(mesh, partition_spec(model.tp, axes)))
        if tuple(value.shape) != tuple(var.shape):
            raise MiniCPMError(f"parameter {'.'.join(map(str, path))} has shape {value.shape}, expected {var.shape}")
        var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
        seen.add(path)
    missing = [".".join(map(str, p)) for p in flat if p not in seen]
    if missing:
        raise MiniCPMError(f"parameters not loaded: {', '.join(missing[:10])}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def target_config(path: str | os.PathLike, *, minicpm4_yarn: bool = False) -> ModelConfig:
    """The checkpoint's :class:`ModelConfig` as :func:`load_model` runs it (with ``--minicpm4_yarn``)."""
    config = ModelConfig.from_pretrained(path)
    return config.with_minicpm4_yarn() if minicpm4_yarn else config


def check_max_length(config: ModelConfig, max_length: int) -> None:
    """MiniCPMError unless ``max_length`` is at least 2 and within the positions the rope supports."""
    if max_length < 2:
        raise MiniCPMError(f"max_length must be at least 2, got {max_length}")
    limit = config.context_limit
    if max_length > limit:
        if config.rope.kind == "longrope" and config.rope.long_factor == MINICPM4_YARN_FACTORS:
            fix = ""  # already MiniCPM4's 128K factors
        elif config.head_dim == 128 and config.model_type == "minicpm":
            fix = ", or use --minicpm4_yarn (MiniCPM4's LongRoPE factors, validated to 131072)"
        else:
            fix = ", or give config.json a rope_scaling that extends the context (yarn, linear, llama3, longrope)"
        raise MiniCPMError(f"max_length {max_length} exceeds the {limit} positions this model supports "
                           f"(max_position_embeddings {config.max_position_embeddings}, rope {config.rope.kind}): "
                           f"lower --max_length{fix}")


def load_model(
    path: str | os.PathLike, *, dtype=jnp.bfloat16, max_length: int = 4096, attention_impl: str = "auto",
    quant: str = "auto", group_size: int = 128, sparse: str | SparseConfig | None = "auto",
    sparse_overrides: dict | None = None, minicpm4_yarn: bool = False, mesh: Mesh | None = None,
) -> MiniCPMForCausalLM:
    """Loads a Hugging Face checkpoint directory (``config.json`` + safetensors; dense, GPTQ or
    marlin-cpmcu) or a native one.

    dtype: weights and activations (``bfloat16`` on GPU; ``float32`` for exact comparisons).
    max_length: the static cache length this model will run with.
    attention_impl: the kernel backend of every op (``auto``, ``xla`` or ``pallas``).
    quant: ``auto`` keeps the checkpoint's weights as they are (int4 stays int4), ``none`` dequantizes an
      int4 checkpoint, ``int4`` quantizes a dense one at load time (round-to-nearest, ``group_size`` rows
      per scale group; use ``checkpoints_convert quantize --method gptq`` for better accuracy).
    sparse, sparse_overrides: InfLLM-v2 mode (``auto``/``on``/``off`` or a SparseConfig) and field
      overrides (``topk``, ``window_size``, ``dense_len``), see :func:`minicpm_jax.infllm.policy.resolve_sparse`.
    minicpm4_yarn: replace the rope factors by MiniCPM4's validated 128K LongRoPE list (CPM.cu's switch).
    mesh: split the model over this mesh (tensor parallelism, ``minicpm_jax.model.parallel.make_mesh``):
      each parameter goes straight to its devices as it is read.
    """
    path = os.fspath(path)
    if quant not in QUANT_CHOICES:
        raise MiniCPMError(f"quant must be one of {', '.join(QUANT_CHOICES)}, got {quant!r}")
    config = target_config(path, minicpm4_yarn=minicpm4_yarn)
    check_max_length(config, max_length)
    sparse = resolve_sparse(config, sparse, **(sparse_overrides or {}))
    kwargs = dict(max_length=max_length, attention_impl=attention_impl, dtype=dtype, sparse=sparse, mesh=mesh)
    if is_native(path):
        model = abstract_model(config, quant=native_quant(path), **kwargs)
        # The checkpoint holds the one-device shapes (a split model's are padded and reordered on filling);
        # it is restored on one device, so a model larger than one device loads from safetensors instead.
        stored = model if mesh is None else abstract_model(config, quant=native_quant(path), **dict(kwargs, mesh=None))
        model = fill_model(model, read_native(path, param_shapes(stored)))
    else:
        files = safetensors_files(path)
        config = resolve_tied_head(config, set(files))
        ck = hf_checkpoint_quant(path, config, files)
        model = abstract_model(config, quant=None if ck is None else ck.spec, **kwargs)
        model = fill_model(model, hf_params(path, config, dtype, files, ck))
    if quant == "none" and model.quant is not None:
        return convert_model(model, None)
    if quant == "int4" and model.quant is None:
        return convert_model(model, QuantSpec(group_size=group_size))
    return model


def weight_bytes(path: str | os.PathLike, *, dtype, quant: str = "auto", group_size: int = 128,
                 minicpm4_yarn: bool = False, tensor_parallel: int = 1) -> int:
    """Bytes of the parameters :func:`load_model` with these arguments holds on each device, from the
    shapes alone (no tensor is read): what ``--max_length auto`` subtracts before sizing the cache.
    tensor_parallel: the devices the model is split over (split parameters count their share)."""
    path = os.fspath(path)
    config = target_config(path, minicpm4_yarn=minicpm4_yarn)
    if is_native(path):
        spec = native_quant(path)
    else:
        files = safetensors_files(path)
        config = resolve_tied_head(config, set(files))
        ck = hf_checkpoint_quant(path, config, files)
        spec = None if ck is None else ck.spec
    if quant == "none":
        spec = None
    elif quant == "int4" and spec is None:
        spec = QuantSpec(group_size=group_size)
    mesh = AbstractMesh((tensor_parallel,), (AXIS,)) if tensor_parallel > 1 else None
    model = abstract_model(config, quant=spec, max_length=2, attention_impl="xla", dtype=dtype, sparse=None, mesh=mesh)
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model)):
        split = any(partition_spec(model.tp, param_axes(var)))
        total += int(np.prod(var.shape)) * jnp.dtype(var.dtype).itemsize // (tensor_parallel if split else 1)
    return total


def shard_model(model: MiniCPMForCausalLM, mesh: Mesh) -> MiniCPMForCausalLM:
    """``model`` (loaded on one device) split over ``mesh`` (tensor parallelism): the same weights in the
    stored layout of :mod:`minicpm_jax.model.parallel`, placed on the mesh's devices. :func:`load_model`
    with ``mesh=`` does this as it reads, without the single-device copy."""
    if model.mesh is not None:
        raise MiniCPMError("the model is already split over a mesh")
    target = abstract_model(model.config, max_length=model.max_length, attention_impl=model.attention_impl,
                            dtype=model.dtype, quant=model.quant, sparse=model.sparse, mesh=mesh)
    return fill_model(target, ((p, v[...]) for p, v in nnx.to_flat_state(nnx.state(model))))


def save_native(model: MiniCPMForCausalLM, dst: str) -> None:
    """Writes ``model``'s parameters and config as a native checkpoint in the existing directory ``dst`` (a
    split model's in the checkpoint's order, as one device holds them)."""
    params = {p: from_layout(model.tp, param_axes(v), v[...]) if model.mesh is not None else v[...]
              for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    write_native(params, model.config.to_hf_dict(), model.dtype, model.quant, dst)


# ------------------------------------------------------------------------------------------- int4 ↔ dense
def decoder_linears(model: MiniCPMForCausalLM) -> Iterator[tuple[ParamPath, nnx.Module]]:
    """``(module path, linear)`` of every decoder linear (the ones int4 checkpoints quantize)."""
    for i, layer in enumerate(model.model.layers):
        for module, linear in DECODER_LINEARS:
            yield ("model", "layers", i, module, linear), getattr(getattr(layer, module), linear)


def int4_linear_weight(linear) -> int4_formats.Int4Weight:
    """An int4 linear's parameters back as :class:`~minicpm_jax.io.int4_formats.Int4Weight` (original row
    order)."""
    arrays = {key: np.asarray(getattr(linear, key)[...]) for key in ("qweight", "scales", "zeros", "perm")
              if hasattr(linear, key)}
    return int4_formats.from_engine(arrays, linear.group_size)


def convert_model(model: MiniCPMForCausalLM, quant: QuantSpec | None) -> MiniCPMForCausalLM:
    """``model`` with its decoder linears re-stored as ``quant`` (None: dense, dequantized weights; a spec:
    round-to-nearest int4 of dense weights). Other parameters are shared, not copied."""
    if quant is not None and model.quant is not None:
        raise MiniCPMError("the model is already int4; re-quantizing int4 weights is not supported")
    if quant is not None:
        quant = dataclasses.replace(quant, act_order=False)
    target = abstract_model(model.config, max_length=model.max_length, attention_impl=model.attention_impl,
                            dtype=model.dtype, quant=quant, sparse=model.sparse, mesh=model.mesh)

    def params():  # in the stored layout: dequantizing and rounding commute with its column order
        linears = dict(decoder_linears(model))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if path[:5] not in linears:
                yield path, var[...]
        for path, linear in linears.items():
            if quant is None:
                yield path + ("kernel",), jnp.asarray(int4_linear_weight(linear).dequantize(), model.dtype)
            else:
                for key, value in rtn_arrays(np.asarray(linear.kernel[...], np.float32), quant, model.dtype).items():
                    yield path + (key,), jnp.asarray(value)

    return fill_model(target, params(), canonical=False)


# ------------------------------------------------------------------------------------------------ drafts
def load_draft(path: str, target: ModelConfig, *, max_length: int, attention_impl: str, dtype) -> EagleDraft:
    """Loads an EAGLE draft directory (tensors plus an optional ``config.json``) for ``target``, in any
    layout :func:`~minicpm_jax.io.draft.engine_draft_names` reads (CPM.cu / SafeAILab, vLLM's MiniCPM EAGLE
    with or without its unused ``model.norm``, EAGLE-3 with ``midlayer`` or ``layers.0``; dense or int4).

    The draft layer's head counts and MLP width come from its ``config.json`` (default: the target's);
    its hidden size (and, for EAGLE-1/2, vocabulary) must match the target's. Missing, unexpected or
    misshapen tensors raise one MiniCPMError listing them.
    """
    if not os.path.isdir(path):
        raise MiniCPMError(f"draft checkpoint directory {path!r} does not exist")
    tensors = engine_draft_names(read_draft_tensors(path))
    names = set(tensors)
    kind = draft_kind_of(names)
    raw = read_config_json(path) if os.path.isfile(os.path.join(path, "config.json")) else {}
    head_rows = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in names else None
    spec = DraftSpec.from_config(raw, target, kind, head_rows)
    cmap = draft_map(spec, names)
    reader = ArrayReader(tensors)
    ck = draft_quant(path, raw, tensors, cmap.linear(("fc",)))
    problems = checkpoint_problems(cmap, reader, ck)
    if kind == "eagle3" and "d2t" in names and not problems:
        mapped = np.arange(spec.draft_vocab) + tensors["d2t"].astype(np.int64)
        if mapped.min() < 0 or mapped.max() >= target.vocab_size:
            problems.append(f"d2t maps draft ids outside the target vocabulary [0, {target.vocab_size})")
    report(problems, f"draft checkpoint {path!r} does not match its target")
    draft = nnx.eval_shape(lambda: EagleDraft(spec, max_length=max_length, attention_impl=attention_impl, dtype=dtype,
                                              quant=None if ck is None else ck.spec))
    return fill_model(draft, read_params(cmap, reader, dtype, ck))


def save_draft(draft: EagleDraft, path: str, *, dtype: str = "float32", layout: str = "cpmcu",
               target: MiniCPMForCausalLM | None = None) -> None:
    """Writes a dense ``draft`` (``model.safetensors`` + ``config.json``, atomically) in a layout
    :func:`load_draft` reads: ``cpmcu`` — CPM.cu / SafeAILab tensor names (EAGLE-3: ``midlayer``, ``d2t``) —
    or ``vllm`` (a MiniCPM draft in vLLM's names, with ``target``'s embedding and lm_head). dtype: of the
    floating-point tensors (``float32`` or ``bfloat16``)."""
    import ml_dtypes

    if os.path.exists(path):
        raise MiniCPMError(f"{path!r} already exists")
    if draft.quant is not None:
        raise MiniCPMError("save_draft writes dense drafts; an int4 draft is kept in its GPTQ / marlin checkpoint")
    floats = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    if dtype not in floats:
        raise MiniCPMError(f"a draft is saved as float32 or bfloat16, not {dtype!r}")
    spec = draft.spec
    if layout == "vllm" and (spec.kind != "minicpm" or target is None):
        raise MiniCPMError("vLLM's layout is for MiniCPM EAGLE drafts and needs the target (its embedding and "
                           "lm_head go into the draft)")
    if layout not in ("cpmcu", "vllm"):
        raise MiniCPMError(f"the draft layout must be cpmcu or vllm, got {layout!r}")
    flat = {k: np.asarray(v[...]).astype(np.int64 if k == ("d2t",) else np.float32)
            for k, v in nnx.to_flat_state(nnx.state(draft))}
    cmap = draft_map(spec, {draft_layer_prefix(spec.kind) + "self_attn.q_proj.weight"})  # split q/k/v, gate/up
    tensors = {t.name: flat[t.path] for t in cmap.tensors}
    for lin in cmap.linears:
        rows = np.split(flat[lin.path + ("kernel",)].T, np.cumsum(lin.widths)[:-1], axis=0)
        tensors.update({name: np.ascontiguousarray(r) for name, r in zip(lin.weight_names, rows)})
    if layout == "vllm":
        embed = np.asarray(target.model.embed_tokens.embedding[...], np.float32)
        tensors = to_vllm_names(tensors, embed, np.asarray(target.head_rows(), np.float32))
    tensors = {k: v if v.dtype == np.int64 else v.astype(floats[dtype]) for k, v in tensors.items()}
    write_draft(path, tensors, spec.to_config())
