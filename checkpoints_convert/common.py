"""Helpers shared by the converters: atomic output directories and sharded safetensors writing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator

import numpy as np
from safetensors.numpy import save_file

from minicpm_jax.errors import MiniCPMError

DEFAULT_SHARD_BYTES = 2 * 1024**3


def check_destination(dst: str, overwrite: bool) -> None:
    """Refuses an existing ``dst`` unless ``overwrite`` (call before any expensive work)."""
    if os.path.exists(dst) and not overwrite:
        raise MiniCPMError(f"destination {os.path.abspath(dst)} already exists; pass --overwrite to replace it")


@contextlib.contextmanager
def atomic_output_dir(dst: str, overwrite: bool = False) -> Iterator[str]:
    """Yields a temporary directory beside ``dst`` that becomes ``dst`` only if the block succeeds.

    An interrupted or failed conversion leaves ``dst`` untouched (absent, or the previous version) and
    removes its temporary directory. An existing ``dst`` is refused unless ``overwrite``.
    """
    dst = os.path.abspath(dst)
    check_destination(dst, overwrite)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.exists(dst):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=parent)
            os.rename(dst, os.path.join(old, "x"))
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ShardedSafetensorsWriter:
    """Writes tensors into ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index.

    Tensors are buffered up to ``shard_bytes`` and flushed, so memory stays around one shard.
    """

    def __init__(self, out_dir: str, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out_dir = out_dir
        self.shard_bytes = shard_bytes
        self._buffer: dict[str, np.ndarray] = {}
        self._buffered = 0
        self._shards: list[str] = []  # flushed shards (temporary file names)
        self._names: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self._buffered and self._buffered + array.nbytes > self.shard_bytes:
            self._flush()
        self._buffer[name] = np.ascontiguousarray(array)
        self._buffered += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        tmp_name = f"shard-{len(self._shards):05d}.tmp"
        save_file(self._buffer, os.path.join(self.out_dir, tmp_name), metadata={"format": "pt"})
        self._shards.append(tmp_name)
        self._names.append(list(self._buffer))
        self._buffer, self._buffered = {}, 0

    def close(self) -> None:
        """Flushes the last shard and names the files (plus the index when there are several)."""
        if self._buffer or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.rename(os.path.join(self.out_dir, self._shards[0]), os.path.join(self.out_dir, "model.safetensors"))
            return
        weight_map = {}
        for i, (tmp_name, names) in enumerate(zip(self._shards, self._names)):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.out_dir, tmp_name), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
