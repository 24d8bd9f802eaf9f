"""FR-Spec vocabulary subsets: the token ids (most frequent first) the draft's head and top-k run over.

Read from CPM.cu's ``freq_{V}.pt`` (a ``torch.save``'d list of ids, read here without torch and without
unpickling anything but plain data), a ``.npy`` array, or a text file of one id per line.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import numpy as np

from minicpm_jax.errors import MiniCPMError


class _ListOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain Python data only (a torch.save'd list of ints needs nothing else)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: an FR-Spec index is a plain list of ids")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("the file holds tensors, not a plain list of token ids")


def _unpickle_torch_save(data: bytes) -> object:
    """The object of a ``torch.save`` file holding plain Python data, read without torch (zip format,
    or the legacy format: magic number, protocol, sys info, then the object)."""
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                raise pickle.UnpicklingError("zip file without data.pkl")
            return _ListOnlyUnpickler(io.BytesIO(z.read(name))).load()
    stream = io.BytesIO(data)
    first = _ListOnlyUnpickler(stream).load()
    if isinstance(first, int) and first == 0x1950A86A20F9469CFC6C:  # torch's legacy magic number
        _ListOnlyUnpickler(stream).load()  # protocol version
        _ListOnlyUnpickler(stream).load()  # sys info
        return _ListOnlyUnpickler(stream).load()
    return first


def read_frspec(path: str, vocab_size: int, subset_size: int | None = None) -> np.ndarray:
    """Token ids of an FR-Spec subset, most frequent first, deduplicated: ``int32[V']``.

    path: a file — CPM.cu's ``freq_{V}.pt`` (a ``torch.save``'d list of ids, read without torch), a
    ``.npy`` array or a text file of one id per line — or a directory holding ``freq_{subset_size}.pt``
    (or ``.npy``). Ids outside ``[0, vocab_size)`` or an empty list raise MiniCPMError.
    """
    if os.path.isdir(path):
        if subset_size is None:
            raise MiniCPMError(f"{path!r} is a directory: give the FR-Spec vocabulary size to pick freq_<size>.pt")
        for ext in (".pt", ".npy"):
            candidate = os.path.join(path, f"freq_{subset_size}{ext}")
            if os.path.isfile(candidate):
                path = candidate
                break
        else:
            raise MiniCPMError(f"no freq_{subset_size}.pt or freq_{subset_size}.npy in {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise MiniCPMError(f"cannot read the FR-Spec index {path!r}: {e}") from None
    try:
        if path.endswith(".npy"):
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        elif path.endswith(".pt"):
            ids = _unpickle_torch_save(data)
        else:
            ids = [int(line) for line in data.decode("utf-8").split()]
        ids = np.asarray(ids).reshape(-1)
    except (pickle.UnpicklingError, EOFError, ValueError, UnicodeDecodeError, zipfile.BadZipFile, TypeError) as e:
        raise MiniCPMError(f"{path!r} is not an FR-Spec index (a list of token ids): {e}") from None
    if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise MiniCPMError(f"{path!r} holds no integer token ids")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise MiniCPMError(f"{path!r} has token ids outside the vocabulary [0, {vocab_size})")
    _, first = np.unique(ids, return_index=True)
    ids = ids[np.sort(first)]  # deduplicated, order kept
    if subset_size is not None:
        ids = ids[:subset_size]
    return ids.astype(np.int32)
