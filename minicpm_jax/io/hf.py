"""Hugging Face model directories (``config.json`` + safetensors; dense, GPTQ or marlin-cpmcu): their
int4 settings and their parameters, read through the checkpoint-name map."""

from __future__ import annotations

import os
from typing import Iterator

import jax

from minicpm_jax.config import ModelConfig
from minicpm_jax.io.int4_checkpoint import MARLIN_CPMCU_FILE, checkpoint_quant
from minicpm_jax.io.names import ParamPath, model_map
from minicpm_jax.io.params import checkpoint_problems, read_params, report
from minicpm_jax.io.safetensors import TensorReader, safetensors_files
from minicpm_jax.quant import CheckpointQuant, QuantSpec, read_quantize_config


def hf_checkpoint_quant(path: str, config: ModelConfig, files: dict[str, str]) -> CheckpointQuant | None:
    """The quantization of a model directory, or None when it is dense (``files``: tensor name → file;
    settings from config.json's ``quantization_config`` or ``quantize_config.json``; a
    ``model_gptq.safetensors`` without either is CPM.cu's marlin-cpmcu default)."""
    names = set(files)
    probe = model_map(config, names).linear(("model", "layers", 0, "self_attn", "o_proj"))
    settings = config.quantization or read_quantize_config(path)
    marlin_file = any(os.path.basename(f) == MARLIN_CPMCU_FILE for f in files.values())
    with TensorReader(files) as reader:
        return checkpoint_quant(path, settings, names, reader.shape, probe, marlin_file=marlin_file)


def hf_params(path: str, config: ModelConfig, dtype, files: dict[str, str] | None = None,
              quant: CheckpointQuant | None = None, spec: QuantSpec | None = None) -> Iterator[tuple[ParamPath, jax.Array]]:
    """Yields ``(param path, array)`` for every parameter of the model directory ``path``, tensor by tensor
    (``config`` with its tied head resolved: :func:`~minicpm_jax.io.names.resolve_tied_head`).

    quant: the checkpoint's int4 settings (:func:`hf_checkpoint_quant`), None when dense; its linears are
    repacked for the model's ``spec`` (default: ``quant.spec``). All names and shapes are checked before any
    tensor is read; problems raise one MiniCPMError.
    """
    files = files or safetensors_files(path)
    with TensorReader(files) as reader:
        cmap = model_map(config, reader.names)
        report(checkpoint_problems(cmap, reader, quant), f"checkpoint {path!r} does not match the model config")
        yield from read_params(cmap, reader, dtype, quant, spec)
