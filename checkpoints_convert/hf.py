"""Hugging Face safetensors directory (dense, GPTQ or marlin-cpmcu) → the native format (Orbax params in the
engine's final layouts; int4 linears repacked into the engine's int4 layout)."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
from flax import nnx

from checkpoints_convert.common import atomic_output_dir, check_destination
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.hf import hf_checkpoint_quant, hf_params
from minicpm_jax.io.names import resolve_tied_head
from minicpm_jax.io.safetensors import safetensors_files
from minicpm_jax.model.loading import abstract_model, fill_model, save_native

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")
DTYPES = ("auto", "bfloat16", "float16", "float32")


def _source_dtype(files: dict[str, str]):
    """The floating dtype most (dense) checkpoint tensors use (for ``--dtype auto``)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                d = f.get_slice(name).get_dtype()
                # int4 checkpoints also hold int32 codes and indices and float16 scales: not the model dtype
                if d.startswith(("F", "BF")) and not name.endswith(".scales"):
                    counts[d] = counts.get(d, 0) + 1
    best = max(counts, key=counts.get)
    return {"BF16": jnp.bfloat16, "F16": jnp.float16}.get(best, jnp.float32)


def copy_side_files(src: str, dst: str, skip: tuple[str, ...] = _WEIGHT_FILES) -> None:
    """Copies tokenizer, chat template and generation config files (everything but weights/config)."""
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if os.path.isfile(full) and not name.endswith(".safetensors") and name not in skip:
            shutil.copy2(full, os.path.join(dst, name))


def convert_hf(src: str, dst: str, *, dtype: str = "auto", overwrite: bool = False, progress: bool = True,
               require_int4: bool = False) -> ModelConfig:
    """Converts the HF directory ``src`` into the native directory ``dst`` atomically; returns its config.

    A GPTQ or marlin-cpmcu ``src`` gives a native int4 checkpoint (``require_int4``: refuse a dense one).
    """
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise MiniCPMError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_destination(dst, overwrite)
    config = ModelConfig.from_pretrained(src)
    files = safetensors_files(src)
    config = resolve_tied_head(config, set(files))
    quant = hf_checkpoint_quant(src, config, files)
    if require_int4 and quant is None:
        raise MiniCPMError(f"{src} is not a GPTQ / marlin-cpmcu checkpoint (no *.qweight tensors); "
                           "make one with `python -m checkpoints_convert quantize`")
    jdtype = _source_dtype(files) if dtype == "auto" else jnp.dtype(dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        model = abstract_model(config, max_length=2, dtype=jdtype, sparse="off", quant=None if quant is None else quant.spec)
        params = hf_params(src, config, jdtype, files, quant)
        total = len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        model = fill_model(model, tqdm(params, total=total, desc="reading", unit="param", disable=not progress))
        with atomic_output_dir(dst, overwrite) as tmp:
            save_native(model, tmp)
            copy_side_files(src, tmp, _WEIGHT_FILES + ("quantize_config.json",))
    return config
