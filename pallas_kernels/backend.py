"""The one place a kernel backend is chosen.

A backend is a namespace module whose functions have identical names and signatures in every backend:
:mod:`pallas_kernels.xla` (plain jnp, the reference) and :mod:`pallas_kernels.triton` (Pallas kernels,
Triton lowering). Users name a backend by its choice name (``--attention_impl``; it selects every op:
attention, tree attention, KV writes, the int4 matmul, InfLLM-v2); the model keeps that name and looks its
ops up here on every call, so a compiled model holds no module object. A Mosaic GPU backend would be one
more entry.
"""

from __future__ import annotations

from types import ModuleType

import jax

from pallas_kernels import triton, xla
from pallas_kernels.flash import kernels_support

AUTO = "auto"
BACKENDS: dict[str, ModuleType] = {"xla": xla, "pallas": triton}
CHOICES = (AUTO, *BACKENDS)
# What every backend namespace provides (checked by the tests).
OPS = ("all_reduce", "attention", "block_sparse_attention", "cache_write", "compress_windows", "gather_last",
       "int4_matmul", "int4_matmul_parts", "matmul", "matmul_parts",
       "paged_attention", "paged_block_sparse_attention", "paged_cache_write", "paged_compress_windows",
       "paged_rope_write", "paged_select_blocks", "paged_sparse_attention", "paged_tree_attention", "residual_add",
       "residual_add_norm", "rope_write", "select_blocks", "sparse_attention", "tree_attention", "tree_merge_attention")


class UnknownBackend(ValueError):
    """A backend name that is not one of :data:`CHOICES`."""


class UnsupportedShape(ValueError):
    """The named backend's kernels cannot run this model's shapes."""


def get(name: str) -> ModuleType:
    """The namespace of the backend ``name`` (a resolved name: ``xla`` or ``pallas``)."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackend(f"kernel backend {name!r} is not available (choose from {', '.join(CHOICES)})") from None


def resolve(name: str, head_dim: int) -> str:
    """``auto`` → ``pallas`` on a GPU when the kernels take ``head_dim`` (a power of 2 ≥ 16), else ``xla``;
    other names are checked (:class:`UnknownBackend`, :class:`UnsupportedShape`) and returned."""
    if name == AUTO:
        return "pallas" if jax.default_backend() == "gpu" and kernels_support(head_dim) else "xla"
    get(name)
    if BACKENDS[name] is triton and not kernels_support(head_dim):
        raise UnsupportedShape(f"kernel backend {name!r} needs a power-of-2 head_dim >= 16, this model has "
                               f"{head_dim} (use xla)")
    return name



def reduces_through_peers(name: str) -> bool:
    """Whether backend ``name``'s ``residual_add`` ops use a mesh's peer-memory workspace (the pallas kernel
    of :mod:`pallas_kernels.peer_all_reduce`) rather than XLA's all-reduce."""
    return get(name) is triton


def interprets(name: str) -> bool:
    """Whether backend ``name``'s kernels run in Pallas interpret mode here (no GPU): correct, but meant for
    tests, and orders of magnitude slower than the references."""
    return get(name) is triton and jax.default_backend() != "gpu"
