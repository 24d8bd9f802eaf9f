"""Checkpoint → model: Hugging Face safetensors (single file or sharded, dense or int4) and the native
Orbax format.

HF: each engine parameter is built from its checkpoint tensors (transposed to ``[in, out]``, q/k/v and
gate/up fused) and cast to the chosen dtype one at a time, so host memory peaks at about one copy of
the weights. Problems (missing, unexpected, mis-shaped tensors, unreadable files) are collected and
reported together in one :class:`MiniCPMError`.

int4 (GPTQ, marlin-cpmcu): the decoder linears are read by :mod:`minicpm_jax.weights_int4`; the rest
(embeddings, norms, lm_head) as above.

Native (written by ``python -m checkpoints_convert hf|gguf|gptq``): ``config.json`` with a
``"minicpm_jax"`` entry (format version, dtype, int4 settings) and an Orbax checkpoint ``params/`` of the
engine's parameters in their final layouts (fused, ``[in, out]``, int4 repacked), so loading is a
straight read with no transposes, concatenations or repacking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import SafetensorError, safe_open

from minicpm_jax import weights_int4
from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model import MiniCPMForCausalLM
from minicpm_jax.quant import QUANT_CHOICES, CheckpointQuant, QuantSpec
from minicpm_jax.sparse import resolve_sparse

ParamPath = tuple  # an NNX state path, e.g. ("model", "layers", 0, "mlp", "down_proj", "kernel")
NATIVE_KEY = "minicpm_jax"  # config.json entry that marks a native checkpoint
NATIVE_FORMAT_VERSION = 1
NATIVE_PARAMS_DIR = "params"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters save; recomputed here


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """How one engine parameter is made: checkpoint tensors (each ``[out, in]`` or 1-D) and a combiner."""

    path: ParamPath
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[[list[jax.Array]], jax.Array]


def _transpose_concat(parts: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([p.T for p in parts], axis=1) if len(parts) > 1 else parts[0].T


def _identity(parts: list[jax.Array]) -> jax.Array:
    return parts[0]


def param_sources(config: ModelConfig, names: set[str], *, int4_linears: bool = False) -> list[ParamSource]:
    """The checkpoint tensors behind every dense parameter of :class:`MiniCPMForCausalLM`.

    ``names`` (the checkpoint's tensor names) decides between split and already-fused q/k/v and gate/up.
    int4_linears: the decoder linears are int4 (see :mod:`minicpm_jax.weights_int4`) and left out here.
    """
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_heads * d, config.num_kv_heads * d
    out = [ParamSource(("model", "embed_tokens", "embedding"), ("model.embed_tokens.weight",), ((config.vocab_size, h),), _identity)]
    for layer in range(config.num_layers):
        pre, path = f"model.layers.{layer}.", ("model", "layers", layer)
        if pre + "self_attn.qkv_proj.weight" in names:
            qkv = ((pre + "self_attn.qkv_proj.weight",), ((nq + 2 * nkv, h),))
        else:
            qkv = (tuple(pre + f"self_attn.{p}_proj.weight" for p in "qkv"), ((nq, h), (nkv, h), (nkv, h)))
        if pre + "mlp.gate_up_proj.weight" in names:
            gate_up = ((pre + "mlp.gate_up_proj.weight",), ((2 * i, h),))
        else:
            gate_up = ((pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"), ((i, h), (i, h)))
        out += [
            ParamSource(path + ("input_layernorm", "weight"), (pre + "input_layernorm.weight",), ((h,),), _identity),
            ParamSource(path + ("post_attention_layernorm", "weight"), (pre + "post_attention_layernorm.weight",), ((h,),), _identity),
        ]
        if not int4_linears:
            out += [
                ParamSource(path + ("self_attn", "qkv_proj", "kernel"), *qkv, _transpose_concat),
                ParamSource(path + ("self_attn", "o_proj", "kernel"), (pre + "self_attn.o_proj.weight",), ((h, nq),), _transpose_concat),
                ParamSource(path + ("mlp", "gate_up_proj", "kernel"), *gate_up, _transpose_concat),
                ParamSource(path + ("mlp", "down_proj", "kernel"), (pre + "mlp.down_proj.weight",), ((h, i),), _transpose_concat),
            ]
    out.append(ParamSource(("model", "norm", "weight"), ("model.norm.weight",), ((h,),), _identity))
    if not config.tied_head:
        out.append(ParamSource(("lm_head", "kernel"), ("lm_head.weight",), ((config.vocab_size, h),), _transpose_concat))
    return out


def safetensors_files(path: str) -> dict[str, str]:
    """Maps every tensor name of a model directory to the safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MiniCPMError(f"cannot read {index}: {e!r}; re-download or re-convert the checkpoint") from None
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if missing:
            raise MiniCPMError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return {name: os.path.join(path, f) for name, f in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise MiniCPMError(
            f"no *.safetensors files in {path!r}; convert GGUF or other checkpoints with `python -m checkpoints_convert`"
        )
    mapping: dict[str, str] = {}
    for f in files:
        full = os.path.join(path, f)
        with _open(full) as handle:
            for name in handle.keys():
                mapping[name] = full
    return mapping


@contextlib.contextmanager
def _open(file: str) -> Iterator:
    try:
        handle = safe_open(file, framework="flax")
    except (SafetensorError, OSError) as e:
        raise MiniCPMError(f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt") from None
    with handle as h:
        yield h


class _TensorReader:
    """Keeps one safetensors handle open per file while parameters are assembled."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open(file))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_optional(self, name: str) -> jax.Array | None:
        return self.get(name) if name in self.files else None

    def get(self, name: str) -> jax.Array:
        try:
            return self._handle(name).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise MiniCPMError(f"cannot read tensor {name!r} from {self.files[name]}: {e}") from None


def resolve_tied_head(config: ModelConfig, names: set[str]) -> ModelConfig:
    """Fixes an unstated ``tie_word_embeddings`` by whether the checkpoint has ``lm_head.weight``."""
    if config.tie_word_embeddings is None:
        return dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in names)
    return config


def _report(problems: Sequence[str], what: str) -> None:
    if problems:
        shown = list(problems[:25]) + ([f"... and {len(problems) - 25} more"] if len(problems) > 25 else [])
        raise MiniCPMError(f"checkpoint {what} does not match the model config:\n  " + "\n  ".join(shown))


def load_hf_params(
    path: str, config: ModelConfig, dtype, files: dict[str, str] | None = None,
    quant: CheckpointQuant | None = None, spec: QuantSpec | None = None,
) -> Iterator[tuple[ParamPath, jax.Array]]:
    """Yields ``(param path, array)`` for every parameter, reading the checkpoint tensor by tensor.

    quant: the checkpoint's int4 settings (:func:`weights_int4.checkpoint_quant`), None when dense; its
    linears are repacked for the model's ``spec`` (default: ``quant.spec``).
    All names and shapes are checked before any tensor is read; problems raise one MiniCPMError.
    """
    files = files or safetensors_files(path)
    names = set(files)
    sources = param_sources(config, names, int4_linears=quant is not None)
    int4_sources = weights_int4.int4_sources(config, names) if quant is not None else []
    with _TensorReader(files) as reader:
        problems, used = [], set()
        if quant is not None:
            problems, used = weights_int4.check_int4_tensors(int4_sources, quant, reader.shape, names)
            used = set(used)
        for src in sources:
            for name, want in zip(src.names, src.shapes):
                used.add(name)
                if name not in names:
                    problems.append(f"missing tensor {name} (expected shape {list(want)})")
                elif reader.shape(name) != want:
                    problems.append(f"tensor {name} has shape {list(reader.shape(name))}, expected {list(want)}")
        tied_extra = {"lm_head.weight"} if config.tied_head else set()
        unexpected = sorted(n for n in names - used - tied_extra if not n.endswith(IGNORED_SUFFIXES))
        problems += [f"unexpected tensor {n}" for n in unexpected]
        _report(problems, repr(path))
        for src in sources:
            parts = [reader.get(name) for name in src.names]
            yield src.path, src.combine(parts).astype(dtype)
            del parts
        if quant is not None:
            yield from weights_int4.load_int4_params(int4_sources, quant, spec or quant.spec, reader.get_optional, dtype)


def abstract_model(config: ModelConfig, **model_kwargs) -> MiniCPMForCausalLM:
    # model_kwargs: those of MiniCPMForCausalLM (max_length, attention_impl, dtype, quant)
    """The model with shape-only parameters (no memory), ready to be filled by a loader."""
    return nnx.eval_shape(lambda: MiniCPMForCausalLM(config, rngs=None, **model_kwargs))


def fill_model(model: MiniCPMForCausalLM, params: Iterator[tuple[ParamPath, jax.Array]]) -> MiniCPMForCausalLM:
    """Replaces the parameters of an (abstract) model by the given arrays; every parameter must be given."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    seen = set()
    for path, value in params:
        var = flat[path]
        if tuple(value.shape) != tuple(var.shape):
            raise MiniCPMError(f"parameter {'.'.join(map(str, path))} has shape {value.shape}, expected {var.shape}")
        var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
        seen.add(path)
    missing = [".".join(map(str, p)) for p in flat if p not in seen]
    if missing:
        raise MiniCPMError(f"parameters not loaded: {', '.join(missing[:10])}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def param_name(path: ParamPath) -> str:
    """Dotted name of a parameter path (the key in a native checkpoint)."""
    return ".".join(str(p) for p in path)


def is_native(path: str) -> bool:
    """Whether ``path`` is a native (Orbax) checkpoint directory."""
    cfg = os.path.join(path, "config.json")
    if not (os.path.isfile(cfg) and os.path.isdir(os.path.join(path, NATIVE_PARAMS_DIR))):
        return False
    try:
        with open(cfg, encoding="utf-8") as f:
            return NATIVE_KEY in json.load(f)
    except (OSError, ValueError):
        return False


def _checkpointer():
    """Orbax PyTree checkpointer without compression: zstd costs more to decode than it saves on
    weights (measured: 3x slower restore of a 0.5B bf16 model on a 2-core CPU)."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save_native(model: MiniCPMForCausalLM, dst: str) -> None:
    """Writes ``model``'s parameters as ``dst/params`` (Orbax) and its config as ``dst/config.json``."""
    import orbax.checkpoint as ocp

    flat = {param_name(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    _checkpointer().save(os.path.join(os.path.abspath(dst), NATIVE_PARAMS_DIR), args=ocp.args.PyTreeSave(flat))
    cfg = model.config.to_hf_dict()
    cfg[NATIVE_KEY] = {"format_version": NATIVE_FORMAT_VERSION, "dtype": model.dtype.name}
    if model.quant is not None:
        cfg[NATIVE_KEY]["int4"] = model.quant.to_dict()
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def native_metadata(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{param name: (shape, dtype name)}`` of a native checkpoint, without reading the arrays."""
    try:
        meta = _checkpointer().metadata(os.path.join(os.path.abspath(path), NATIVE_PARAMS_DIR))
    except Exception as e:  # orbax raises many types for damaged directories
        raise MiniCPMError(f"{path}/{NATIVE_PARAMS_DIR} is not a readable Orbax checkpoint: {e}") from None
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, Mapping) or not tree:  # an emptied directory reads as no metadata
        raise MiniCPMError(f"{path}/{NATIVE_PARAMS_DIR} is not a readable Orbax checkpoint (no parameter metadata)")
    return {name: (tuple(m.shape), jnp.dtype(m.dtype).name) for name, m in tree.items()}


def native_quant(path: str) -> QuantSpec | None:
    """The int4 settings a native checkpoint was written with (None: dense)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        entry = json.load(f).get(NATIVE_KEY, {})
    raw = entry.get("int4") if isinstance(entry, dict) else None
    return None if raw is None else QuantSpec.from_dict(raw)


def load_native_params(path: str, model: MiniCPMForCausalLM) -> Iterator[tuple[ParamPath, jax.Array]]:
    """Restores a native checkpoint's parameters for the (abstract) ``model``, each cast to the dtype of
    the model's parameter (the model dtype; int4 codes stay int32, scales float16/float32)."""
    import orbax.checkpoint as ocp

    abstract = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    meta = native_metadata(path)
    problems = []
    for p, var in abstract.items():
        name = param_name(p)
        if name not in meta:
            problems.append(f"missing parameter {name} (expected shape {list(var.shape)})")
        elif meta[name][0] != tuple(var.shape):
            problems.append(f"parameter {name} has shape {list(meta[name][0])}, expected {list(var.shape)}")
    expected = {param_name(p) for p in abstract}
    problems += [f"unexpected parameter {n}" for n in sorted(set(meta) - expected)]
    _report(problems, repr(path))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {param_name(p): jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for p, v in abstract.items()}
    restore_args = {k: ocp.ArrayRestoreArgs(sharding=sharding, dtype=v.dtype) for k, v in target.items()}
    try:
        restored = _checkpointer().restore(
            os.path.join(os.path.abspath(path), NATIVE_PARAMS_DIR),
            args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
        )
    except Exception as e:
        raise MiniCPMError(f"cannot restore {path}/{NATIVE_PARAMS_DIR}: {e}") from None
    for p in abstract:
        yield p, restored[param_name(p)]


def load_model(
    path: str | os.PathLike, *, dtype=jnp.bfloat16, max_length: int = 4096, attention_impl: str = "auto",
    quant: str = "auto", group_size: int = 128, sparse: str | SparseConfig | None = "auto",
    sparse_overrides: dict | None = None,
) -> MiniCPMForCausalLM:
    """Loads a Hugging Face checkpoint directory (``config.json`` + safetensors; dense, GPTQ or
    marlin-cpmcu) or a native one.

    dtype: weights and activations (``bfloat16`` on GPU; ``float32`` for exact comparisons).
    max_length: the static cache length this model will run with.
    quant: ``auto`` keeps the checkpoint's weights as they are (int4 stays int4), ``none`` dequantizes an
      int4 checkpoint, ``int4`` quantizes a dense one at load time (round-to-nearest, ``group_size`` rows
      per scale group; use ``checkpoints_convert quantize --method gptq`` for better accuracy).
    sparse, sparse_overrides: InfLLM-v2 mode (``auto``/``on``/``off`` or a SparseConfig) and field
      overrides (``topk``, ``window_size``, ``dense_len``), see :func:`minicpm_jax.sparse.resolve_sparse`.
    """
    path = os.fspath(path)
    if quant not in QUANT_CHOICES:
        raise MiniCPMError(f"quant must be one of {', '.join(QUANT_CHOICES)}, got {quant!r}")
    config = ModelConfig.from_pretrained(path)
    if max_length < 2:
        raise MiniCPMError(f"max_length must be at least 2, got {max_length}")
    sparse = resolve_sparse(config, sparse, **(sparse_overrides or {}))
    kwargs = dict(max_length=max_length, attention_impl=attention_impl, dtype=dtype, sparse=sparse)
    if is_native(path):
        model = abstract_model(config, quant=native_quant(path), **kwargs)
        model = fill_model(model, load_native_params(path, model))
    else:
        files = safetensors_files(path)
        config = resolve_tied_head(config, set(files))
        ck = weights_int4.checkpoint_quant(path, config, files)
        model = abstract_model(config, quant=None if ck is None else ck.spec, **kwargs)
        model = fill_model(model, load_hf_params(path, config, dtype, files, ck))
    if quant == "none" and model.quant is not None:
        return weights_int4.convert_model(model, None)
    if quant == "int4" and model.quant is None:
        return weights_int4.convert_model(model, QuantSpec(group_size=group_size))
    return model
