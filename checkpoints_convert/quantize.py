"""``python -m checkpoints_convert quantize``: a dense Hugging Face checkpoint → a GPTQ int4 checkpoint.

Methods:

* ``rtn``: round-to-nearest per group (no data needed).
* ``gptq``: GPTQ (Frantar et al. 2022; ``checkpoints_convert.gptq_solver``). Layer by layer, the
  calibration text runs through the model with the layers before already quantized; the inputs of each
  decoder linear give its Hessian ``H = 2/n · Σ x xᵀ``, and the solver quantizes the weight column by column
  with error feedback (damped Cholesky of H⁻¹, optional act-order). q/k/v and gate/up share their inputs,
  so they are solved fused, as the engine stores them.

The output is a standard GPTQ checkpoint (``qweight``/``qzeros``/``scales``/``g_idx`` under split
names, ``quantization_config`` in config.json) that this engine, transformers/AutoGPTQ and
``checkpoints_convert gptq --layout marlin`` read. Embeddings, norms and lm_head are copied unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints_convert.common import ShardedSafetensorsWriter, atomic_output_dir, check_destination
from checkpoints_convert.gptq import dense_tensor_names, write_gptq_config, write_gptq_tensors
from checkpoints_convert.gptq_solver import HessianAccumulator, gptq_quantize
from checkpoints_convert.hf import copy_side_files
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io import int4_formats as int4
from minicpm_jax.io.hf import hf_checkpoint_quant
from minicpm_jax.io.names import DECODER_LINEARS, resolve_tied_head
from minicpm_jax.io.safetensors import TensorReader, safetensors_files
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.loading import load_model
from minicpm_jax.quant import QuantSpec, fitting_group_sizes

METHODS = ("rtn", "gptq")
DEFAULT_GROUP_SIZE = 128


@dataclasses.dataclass
class GPTQSettings:
    damp_percent: float = 0.01
    seq_length: int = 512  # tokens per calibration sequence
    num_samples: int = 128  # calibration sequences at most
    block_size: int = 128  # rows per lazy GPTQ batch
    # GPTAQ's asymmetric calibration: fit each linear to the full-precision model's output for the same
    # tokens, and quantize a layer's linears in order (each on the inputs its quantized predecessors give).
    asym_calibration: bool = True


class _Capture(nnx.Module):
    """Wraps a linear and keeps its latest input (float32 ``[n, K]``) in ``sink[key]`` (``sink`` None:
    keeps nothing). With ``feed`` (that input as an earlier pass kept it) the linear runs on ``feed``
    instead of what it is called with, so XLA drops the layer's work that only led there."""

    def __init__(self, linear, key, sink: dict | None, feed=None):
        self.linear, self.key, self.sink, self.feed = linear, key, sink, feed

    def __call__(self, x):
        return self.linear(self._input(x))

    def partial(self, x):
        """The linear's :meth:`~minicpm_jax.model.layers.Linear.partial` (what ``o_proj`` and ``down_proj``
        are called through), input kept."""
        return self.linear.partial(self._input(x))

    def _input(self, x):
        if self.feed is not None:
            x = self.feed.reshape(x.shape).astype(x.dtype)
        if self.sink is not None:
            self.sink[self.key] = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        return x


class _LayerRunner:
    """Runs one decoder layer over the calibration batch ``[S, T, hidden]`` under ``jax.jit`` and returns
    its output and the inputs of the linears asked for. Every layer has the same structure, so each set of
    captured (and fed) linears compiles once (eager, the op-by-op forward was two thirds of GPTQ's time on
    a CPU)."""

    def __init__(self, config: ModelConfig, s: int, t: int):
        self._graphdef = None  # taken from the first layer: a GraphDef compares by identity, so a static
        # argument of each layer's own would recompile every call

        def forward(state, h, names, output, feeds):
            layer = nnx.merge(self._graphdef, state)
            sink = {}
            for module, name in dict.fromkeys([*names, *feeds]):
                parent = getattr(layer, module)
                setattr(parent, name, _Capture(getattr(parent, name), (module, name),
                                               sink if (module, name) in names else None, feeds.get((module, name))))
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
            out = layer(h, positions, jnp.ones((s, t), bool), KVCache.create(config, s, t, jnp.float32),
                        jnp.full((s,), t, jnp.int32))[0]
            return (out if output else None), sink

        self._forward = jax.jit(forward, static_argnums=(2, 3))

    def __call__(self, layer, h, names=(), output: bool = True, feeds=None) -> tuple[jax.Array | None, dict]:
        """``(output [S, T, hidden], {(module, name): input f32 [S*T, K]})`` for the linears ``names``.
        With ``output=False`` the output is None and XLA drops the work after the last captured input.
        ``feeds``: ``{(module, name): input [S*T, K]}`` the linears run on instead of their own inputs (as
        an earlier pass captured them: the same values where the weights before them are unchanged)."""
        graphdef, state = nnx.split(layer)
        if self._graphdef is None:
            self._graphdef = graphdef
        return self._forward(state, h, tuple(names), output, dict(feeds or {}))


def calibration_tokens(src: str, text_file: str, settings: GPTQSettings) -> np.ndarray:
    """``int32 [S, T]``: the calibration text tokenized with the model's tokenizer, cut into sequences."""
    from minicpm_jax.tokenizer import load_tokenizer

    try:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MiniCPMError(f"cannot read --calibration_file {text_file}: {e}") from None
    ids = load_tokenizer(src)(text, add_special_tokens=False)["input_ids"]
    t = min(settings.seq_length, len(ids))
    if t < 16:
        raise MiniCPMError(f"--calibration_file {text_file} has {len(ids)} tokens; GPTQ needs at least 16")
    n = min(settings.num_samples, len(ids) // t)
    return np.asarray(ids[: n * t], np.int32).reshape(n, t)


def _linears(layer):
    for module, name in DECODER_LINEARS:
        yield module, name, getattr(getattr(layer, module), name)


def gptq_calibrate(model, tokens: np.ndarray, spec: QuantSpec, settings: GPTQSettings,
                   progress: bool = True) -> dict[tuple, int4.Int4Weight]:
    """GPTQ of every decoder linear of the dense float32 ``model`` on calibration ``tokens [S, T]``."""
    from tqdm import tqdm

    s, t = tokens.shape
    run = _LayerRunner(model.config, s, t)
    x = model.embed(jnp.asarray(tokens)).astype(jnp.float32)
    x_ref = x if settings.asym_calibration else None  # the full-precision model's hidden states
    out = {}

    def quantize(i, module, name, linear, acc):
        w = np.asarray(linear.kernel[...], np.float32)
        qw = gptq_quantize(w, acc.hessian, group_size=spec.group_size, sym=spec.sym, desc_act=spec.act_order,
                           damp_percent=settings.damp_percent, block_size=settings.block_size, cross=acc.cross)
        zeros = None if spec.sym else qw.zero.astype(np.float32)
        out[("model", "layers", i, module, name)] = int4.Int4Weight(qw.q, qw.scale, zeros, qw.g_idx,
                                                                    spec.rows_per_group(w.shape[0]))
        linear.kernel.value = jnp.asarray(qw.dequantize(), jnp.float32)  # later inputs see int4 effects

    for i, layer in enumerate(tqdm(model.model.layers, desc="GPTQ", unit="layer", disable=not progress)):
        linears = {(module, name): linear for module, name, linear in _linears(layer)}  # qkv, o, gate_up, down
        if x_ref is None:  # classic GPTQ: every linear of the layer on the inputs of the original layer
            _, inputs = run(layer, x, list(linears))
            for (module, name), linear in linears.items():
                acc = HessianAccumulator(linear.kernel.shape[0])
                acc.add(inputs[(module, name)])
                quantize(i, module, name, linear, acc)
            x, _ = run(layer, x)
            continue
        x_ref, ref_inputs = run(layer, x_ref, list(linears))  # still the full-precision weights
        # Each pass starts at the linear quantized last, fed the input the pass before kept (quantizing a
        # linear does not change its own input): XLA drops the layer's front instead of recomputing it,
        # the same values for about 3/5 of the work (this path's attention runs once a layer, not four times).
        inputs, before = {}, None
        for (module, name), linear in linears.items():
            feeds = {before: inputs[before]} if before else {}
            inputs.update(run(layer, x, [(module, name)], output=False, feeds=feeds)[1])
            acc = HessianAccumulator(linear.kernel.shape[0])
            acc.add(inputs[(module, name)], ref_inputs[(module, name)])
            quantize(i, module, name, linear, acc)
            before = (module, name)
        # The output: each sublayer's last linear (o_proj, down_proj) fed its kept input.
        last = {module: (module, name) for module, name in linears}
        x, _ = run(layer, x, feeds={key: inputs[key] for key in last.values()})
    return out


def rtn_weights(model, spec: QuantSpec) -> dict[tuple, int4.Int4Weight]:
    """Round-to-nearest int4 of every decoder linear of ``model``."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for module, name, linear in _linears(layer):
            w = np.asarray(linear.kernel[...], np.float32)
            out[("model", "layers", i, module, name)] = int4.rtn_quantize(
                w, group_size=spec.rows_per_group(w.shape[0]), sym=spec.sym)
    return out


def _group_size(config: ModelConfig, requested: int | None) -> int:
    """The scale group size to quantize with: ``requested``, which must divide every linear's input width,
    or (None) 128, else the largest multiple of 16 below it that divides them (said on stderr)."""
    widths = sorted({config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim})
    fits = fitting_group_sizes(widths, DEFAULT_GROUP_SIZE)
    choices = ", ".join(map(str, fits)) + (" or " if fits else "") + "-1 (per-channel)"
    if requested is not None:
        QuantSpec(group_size=requested)  # -1 or a positive multiple of 16
        if requested == -1 or all(k % requested == 0 for k in widths):
            return requested
        raise MiniCPMError(f"--group_size {requested} does not divide this model's linear widths "
                           f"({', '.join(map(str, widths))}); sizes that fit: {choices}")
    if not fits:
        raise MiniCPMError(f"no group size up to {DEFAULT_GROUP_SIZE} divides this model's linear widths "
                           f"({', '.join(map(str, widths))}); pass --group_size -1 (per-channel)")
    if fits[0] != DEFAULT_GROUP_SIZE:
        print(f"note: group size {DEFAULT_GROUP_SIZE} does not divide this model's linear widths "
              f"({', '.join(map(str, widths))}); quantizing with group size {fits[0]}", file=sys.stderr)
    return fits[0]


def quantize_checkpoint(src: str, dst: str, *, method: str = "gptq", group_size: int | None = None, sym: bool = True,
                        desc_act: bool = False, calibration_file: str | None = None,
                        settings: GPTQSettings | None = None, checkpoint_format: str = "auto",
                        overwrite: bool = False, progress: bool = True) -> QuantSpec:
    """Writes the int4 GPTQ checkpoint of the dense HF checkpoint ``src`` to ``dst`` (atomically)."""
    settings = settings or GPTQSettings()
    if method not in METHODS:
        raise MiniCPMError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "gptq" and not calibration_file:
        raise MiniCPMError("--method gptq needs --calibration_file (a UTF-8 text file; a few thousand tokens of "
                           "text like the model's use)")
    if method == "gptq" and not os.path.isfile(calibration_file):
        raise MiniCPMError(f"--calibration_file {calibration_file} does not exist")
    if method == "rtn" and desc_act:
        raise MiniCPMError("--desc_act only applies to --method gptq")
    if checkpoint_format not in ("auto", "gptq", "gptq_v2"):
        raise MiniCPMError(f"--checkpoint_format must be auto, gptq or gptq_v2, got {checkpoint_format!r}")
    if checkpoint_format == "auto":
        checkpoint_format = "gptq" if sym else "gptq_v2"
    if checkpoint_format == "gptq" and not sym:
        # Checked before any work: an asymmetric group whose zero point is 0 (its weights all >= 0, common
        # at small group sizes) cannot be written in v1, which would be found only after calibration.
        raise MiniCPMError("--asym needs --checkpoint_format gptq_v2 (or auto, the default): checkpoint_format "
                           "gptq (v1) stores zero points minus one in 4 bits and cannot store a zero point of 0")
    check_destination(dst, overwrite)
    config = ModelConfig.from_pretrained(src)
    files = safetensors_files(src)
    config = resolve_tied_head(config, set(files))
    if hf_checkpoint_quant(src, config, files) is not None:
        raise MiniCPMError(f"{src} is already quantized; quantize a dense (bf16/fp16/fp32) checkpoint")
    spec = QuantSpec(group_size=_group_size(config, group_size), sym=sym, act_order=desc_act)
    model = load_model(src, dtype=jnp.float32, attention_impl="xla", max_length=max(settings.seq_length, 2),
                       sparse="off")  # calibration layers run on plain KV caches
    if method == "rtn":
        linears = rtn_weights(model, spec)
    else:
        tokens = calibration_tokens(src, calibration_file, settings)
        print(f"calibrating on {tokens.shape[0]} x {tokens.shape[1]} tokens", file=sys.stderr)
        linears = gptq_calibrate(model, tokens, spec, settings, progress)
    del model
    with atomic_output_dir(dst, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp)
        with TensorReader(files) as reader:
            for name in dense_tensor_names(config, set(files)):
                writer.add(name, np.asarray(reader.get(name)))
        write_gptq_tensors(writer, config, linears, checkpoint_format)
        writer.close()
        write_gptq_config(src, tmp, spec, checkpoint_format)
        copy_side_files(src, tmp)
    return spec

