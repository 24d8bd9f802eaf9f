"""Hugging Face safetensors directory → the native format (Orbax params in the engine's final layouts)."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp

from checkpoints_convert.common import atomic_output_dir, check_destination
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.weights import (
    abstract_model, fill_model, load_hf_params, param_sources, resolve_tied_head, save_native,
    safetensors_files,
)

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")
DTYPES = ("auto", "bfloat16", "float16", "float32")


def _source_dtype(files: dict[str, str]):
    """The floating dtype most checkpoint tensors use (for ``--dtype auto``)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                d = f.get_slice(name).get_dtype()
                counts[d] = counts.get(d, 0) + 1
    best = max(counts, key=counts.get)
    return {"BF16": jnp.bfloat16, "F16": jnp.float16}.get(best, jnp.float32)


def copy_side_files(src: str, dst: str) -> None:
    """Copies tokenizer, chat template and generation config files (everything but weights/config)."""
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if os.path.isfile(full) and not name.endswith(".safetensors") and name not in _WEIGHT_FILES:
            shutil.copy2(full, os.path.join(dst, name))


def convert_hf(src: str, dst: str, *, dtype: str = "auto", overwrite: bool = False, progress: bool = True) -> ModelConfig:
    """Converts the HF directory ``src`` into the native directory ``dst`` atomically; returns its config."""
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise MiniCPMError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_destination(dst, overwrite)
    config = ModelConfig.from_pretrained(src)
    files = safetensors_files(src)
    config = resolve_tied_head(config, set(files))
    jdtype = _source_dtype(files) if dtype == "auto" else jnp.dtype(dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        model = abstract_model(config, max_length=2, dtype=jdtype)
        params = load_hf_params(src, config, jdtype, files)
        total = len(param_sources(config, set(files)))
        model = fill_model(model, tqdm(params, total=total, desc="reading", unit="param", disable=not progress))
        with atomic_output_dir(dst, overwrite) as tmp:
            save_native(model, tmp)
            copy_side_files(src, tmp)
    return config
