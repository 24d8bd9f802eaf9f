"""Reading safetensors checkpoints: a model directory's tensor → file map (single file, sharded with an
index, or several files without one) and readers that open each file once and read tensor by tensor."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, Mapping

import numpy as np
from safetensors import SafetensorError, safe_open

from minicpm_jax.errors import MiniCPMError


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
        with open_safetensors(full) as handle:
            for name in handle.keys():
                mapping[name] = full
    return mapping


@contextlib.contextmanager
def open_safetensors(file: str) -> Iterator:
    """A ``safe_open`` handle (arrays as jax arrays); MiniCPMError for unreadable files."""
    try:
        handle = safe_open(file, framework="flax")
    except (SafetensorError, OSError) as e:
        raise MiniCPMError(f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt") from None
    with handle as h:
        yield h


class TensorReader:
    """Reads tensors of a ``{name: file}`` map, keeping one safetensors handle open per file (use as a
    context manager). ``names``, ``shape(name)``, ``get(name)`` (a jax array) and ``get_optional(name)``
    (None when absent) are the reader interface the parameter loaders take."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self.names = set(files)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(open_safetensors(file))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_optional(self, name: str):
        return self.get(name) if name in self.files else None

    def get(self, name: str):
        try:
            return self._handle(name).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise MiniCPMError(f"cannot read tensor {name!r} from {self.files[name]}: {e}") from None


class ArrayReader:
    """The reader interface of :class:`TensorReader` over tensors already in memory (a draft's)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = tensors
        self.names = set(tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get_optional(self, name: str):
        return self.tensors.get(name)

    def get(self, name: str):
        return self.tensors[name]
