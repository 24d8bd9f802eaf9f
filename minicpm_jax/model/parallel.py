"""Tensor parallelism: one model over the devices of a mesh axis (Megatron layout, JAX SPMD).

Every decision about splitting a model lives here:

* **Logical axes.** Each parameter carries the names of its axes (``nnx.Param(..., axes=(EMBED, QKV))``);
  :data:`SHARDED` names the axes split over the mesh axis :data:`AXIS`. q/k/v and gate/up are
  column-parallel, o and down row-parallel, the embedding and lm_head vocab-parallel; norms and the
  EAGLE draft are replicated. The KV cache (and InfLLM-v2's compressed keys) is split with its heads.
* **Layout.** :class:`TensorParallel` says what one shard holds. The fused ``qkv_proj`` is stored shard
  by shard (``[q | k | v]`` of shard 0, then of shard 1, ...) and so is ``gate_up_proj``, so each
  device's block is a complete fused projection; with more devices than KV heads every KV head is
  replicated on the ``size / num_kv_heads`` devices whose query heads use it. The vocabulary is padded
  so that each shard holds a multiple of :data:`VOCAB_ALIGN` rows. :func:`to_layout` / :func:`from_layout`
  convert a checkpoint's (canonical) arrays.
* **Collectives.** A step runs as one SPMD program (:func:`spmd`, ``shard_map`` over the whole step, so the
  Pallas kernels run per shard on local blocks) whose only communication is written out in the model through
  :class:`TensorParallel`: one all-reduce of each row-parallel sublayer's partial sums (fp32; bf16 past 256K
  elements: ``pallas_kernels.residual``) at the block boundary (the decoder layer's ``residual_add`` /
  ``residual_add_norm`` backend ops over :attr:`~TensorParallel.reduce_axis`, fused with the residual add
  and the next norm), one for the vocab-parallel embedding lookup, and one all-gather of the logits. They are
  XLA's (NCCL or its one-shot kernel) unless :func:`use_peer_all_reduce` gave the mesh a peer-memory workspace
  (``--tp_all_reduce peer``): then the pallas backend's ops (``residual_add_norm`` at the block boundary, the
  lookup's ``all_reduce`` and the logits' ``gather_last``, ``pallas_kernels.collectives``) go through its kernel
  when the message fits it, which XLA keeps inside the step's CUDA graph (``pallas_kernels.peer_all_reduce``).
  Act-order int4 row-parallel linears all-gather their input first, and sparse attention with a KV head shared
  by several devices all-gathers the selection queries (XLA's, either way).

A model without a mesh runs exactly the single-device program (size 1, no ``shard_map``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.paged_cache import PagedKVCache
from minicpm_jax.quant import QuantSpec
from pallas_kernels import backend
from pallas_kernels.peer_all_reduce import PeerAccessError, PeerWorkspace, allocate_workspace

AXIS = "tp"  # the mesh axis tensor parallelism splits over

# Logical axis names of parameters.
EMBED = "embed"  # hidden size (replicated)
VOCAB = "vocab"  # vocabulary rows of the embedding / columns of lm_head (split, padded)
QKV = "qkv"  # fused q/k/v output columns (split shard by shard)
HEADS = "heads"  # attention output = o_proj input (split by query heads)
GATE_UP = "gate_up"  # fused gate/up output columns (split shard by shard)
MLP = "mlp"  # MLP intermediate = down_proj input (split)
SHARDED = frozenset({VOCAB, QKV, HEADS, GATE_UP, MLP})

REPLICATED = P()
MAX_SIZE = 64  # largest size :meth:`TensorParallel.valid_sizes` lists
# A shard's vocabulary rows are a multiple of this: XLA's GEMM reads lm_head's block at the copy rate only when its
# rows start 16-byte aligned (2× H200, session 50, one row against MiniCPM4-8B's head split in 2: 36,724 columns
# 116 µs a call, 36,736 69 µs).
VOCAB_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """What each of ``size`` devices holds of a model (``size`` 1: everything, no collectives).

    Per shard: ``q_heads`` query heads, ``kv_heads`` KV heads (each KV head on ``kv_copies`` devices when
    there are more devices than KV heads), ``intermediate_size / size`` MLP channels, ``vocab_padded /
    size`` vocabulary rows. Frozen and hashable: it sits in a module's static attributes.
    """

    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    peers: PeerWorkspace | None = None  # the axis' peer-memory workspace (size > 1 only), or None
    impl: str = "xla"  # the kernel backend whose collective ops run the model's sums and gathers

    @classmethod
    def of(cls, config: ModelConfig, size: int = 1, quant: QuantSpec | None = None,
           peers: PeerWorkspace | None = None, impl: str = "xla") -> "TensorParallel":
        """The layout of ``config`` over ``size`` devices (with ``peers``, the mesh's :func:`peer_workspace`,
        which the collective ops of the kernel backend ``impl`` may use: ``pallas_kernels.collectives``);
        MiniCPMError (naming the sizes that work) when ``size`` does not split the heads, the MLP or, for int4
        weights, whole scale groups of the row-parallel linears."""
        tp = cls(size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                 config.vocab_size, peers if size > 1 else None, impl)
        problem = tp.problem(quant)
        if problem:
            sizes = ", ".join(map(str, cls.valid_sizes(config, quant)))
            raise MiniCPMError(f"tensor parallelism over {size} devices: {problem}; sizes that work for this model: "
                               f"{sizes}")
        return tp

    @classmethod
    def valid_sizes(cls, config: ModelConfig, quant: QuantSpec | None = None, limit: int = MAX_SIZE) -> list[int]:
        """The sizes up to ``limit`` that split ``config`` (with ``quant``'s scale groups)."""
        make = functools.partial(cls, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                 head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                                 vocab_size=config.vocab_size)
        return [n for n in range(1, limit + 1) if not make(n).problem(quant)]

    def problem(self, quant: QuantSpec | None = None) -> str | None:
        """Why this layout cannot be built, or None."""
        n, h, kvh = self.size, self.num_heads, self.num_kv_heads
        if n < 1:
            return "the size must be >= 1"
        if h % n:
            return f"{n} does not divide the {h} attention heads"
        if kvh % n and n % kvh:
            return f"{n} neither divides nor is a multiple of the {kvh} KV heads"
        if self.intermediate_size % n:
            return f"{n} does not divide the MLP's {self.intermediate_size} channels"
        if quant is not None and n > 1:
            for name, k in (("o_proj", h * self.head_dim), ("down_proj", self.intermediate_size)):
                rows = k // n
                if quant.group_size != -1 and (rows % quant.group_size or rows % 8):
                    return (f"{name}'s {k} input rows split into {rows} per device, not whole int4 scale groups "
                            f"of {quant.group_size}")
        return None

    # ------------------------------------------------------------------------------------ the layout
    @property
    def q_heads(self) -> int:
        """Query heads per shard."""
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads per shard (1 when KV heads are replicated)."""
        return max(self.num_kv_heads // self.size, 1)

    @property
    def stored_kv_heads(self) -> int:
        """KV heads over all shards, copies included: the cache's head axis."""
        return self.kv_heads * self.size

    @property
    def kv_copies(self) -> int:
        """Devices holding each KV head (1 unless there are more devices than KV heads)."""
        return self.stored_kv_heads // self.num_kv_heads

    @property
    def splits_groups(self) -> bool:
        """Whether one KV head's query heads (its GQA group) are spread over several devices."""
        return self.kv_copies > 1

    @property
    def vocab_padded(self) -> int:
        """Vocabulary rows stored: the vocabulary itself at size 1, else rounded up so that each shard holds a
        multiple of :data:`VOCAB_ALIGN` rows."""
        if self.size == 1:
            return self.vocab_size
        return -(-self.vocab_size // (self.size * VOCAB_ALIGN)) * self.size * VOCAB_ALIGN

    def kv_head_of_shard(self) -> np.ndarray:
        """``int[stored_kv_heads]``: the model's KV head behind each stored KV head."""
        return np.arange(self.stored_kv_heads) // self.kv_copies

    def qkv_columns(self) -> np.ndarray:
        """For each column of the stored fused q/k/v projection, its column in the checkpoint's
        ``[q (H·D) | k (KVH·D) | v (KVH·D)]`` order: shard by shard, each ``[q | k | v]``."""
        d, h, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        heads = np.arange(d)
        kv_of = self.kv_head_of_shard().reshape(self.size, self.kv_heads)
        cols = []
        for s in range(self.size):
            q = [g * d + heads for g in range(s * self.q_heads, (s + 1) * self.q_heads)]
            k = [h * d + g * d + heads for g in kv_of[s]]
            v = [(h + kvh) * d + g * d + heads for g in kv_of[s]]
            cols += q + k + v
        return np.concatenate(cols)

    def gate_up_columns(self) -> np.ndarray:
        """For each column of the stored fused gate/up projection, its column in ``[gate (I) | up (I)]``:
        shard by shard, each ``[gate | up]`` of its ``I / size`` channels."""
        i, per = self.intermediate_size, self.intermediate_size // self.size
        return np.concatenate([np.r_[s * per : (s + 1) * per, i + s * per : i + (s + 1) * per]
                               for s in range(self.size)])

    # ------------------------------------------------------------------------------------ collectives
    @property
    def reduce_axis(self) -> str | None:
        """The mesh axis a row-parallel sublayer's partial sums are reduced over at the block boundary
        (``pallas_kernels.residual``), or None at size 1 (nothing to reduce)."""
        return AXIS if self.size > 1 else None

    def all_reduce(self, x: jax.Array) -> jax.Array:
        """Sum of the shards' ``x`` (the embedding lookup's rows, a row-parallel linear's partial results);
        identity at size 1. The backend's ``all_reduce`` (``pallas_kernels.collectives``): with a peer-memory
        workspace the pallas one sums a small message through its kernel, inside the step's CUDA graph."""
        return backend.get(self.impl).all_reduce(x, axis_name=AXIS, peers=self.peers) if self.size > 1 else x

    def all_gather(self, x: jax.Array, axis: int) -> jax.Array:
        """The shards' blocks of ``x`` concatenated along ``axis``; identity at size 1."""
        return lax.all_gather(x, AXIS, axis=axis % x.ndim, tiled=True) if self.size > 1 else x

    def lookup(self, table: jax.Array, ids: jax.Array) -> jax.Array:
        """Rows ``ids int32[...]`` of a vocab-parallel ``table [vocab_padded / size, H]`` → ``[..., H]``:
        each shard looks up the ids it holds, the others contribute zeros (exact)."""
        if self.size == 1:
            return jnp.take(table, ids, axis=0)
        rows = table.shape[0]
        local = ids - lax.axis_index(AXIS) * rows
        inside = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.where(inside, local, 0), axis=0)
        return self.all_reduce(jnp.where(inside[..., None], x, jnp.zeros((), x.dtype)))

    def gather_vocab(self, logits: jax.Array) -> jax.Array:
        """Vocab-parallel logits ``[..., vocab_padded / size]`` → ``[..., vocab_size]`` on every shard, through the
        backend's ``gather_last`` (the pallas one, with a peer-memory workspace, a decode step's few rows as a sum
        through its kernel)."""
        if self.size == 1:
            return logits
        return backend.get(self.impl).gather_last(logits, axis_name=AXIS, peers=self.peers)[..., : self.vocab_size]

    def group_queries(self, q: jax.Array) -> jax.Array:
        """``q [B, T, q_heads, D]`` → the queries of this shard's whole GQA group ``[B, T, H / KVH, D]``
        when the group is spread over several devices (InfLLM-v2's block selection sums stage-1 scores
        over the group), else ``q``."""
        if not self.splits_groups:
            return q
        group = self.num_heads // self.num_kv_heads
        kv_head = lax.axis_index(AXIS) // self.kv_copies
        return lax.dynamic_slice_in_dim(self.all_gather(q, 2), kv_head * group, group, axis=2)


# ---------------------------------------------------------------------------------------------- layout
def to_layout(tp: TensorParallel, axes: Sequence[str | None], value: jax.Array) -> jax.Array:
    """A checkpoint's (canonical) array of a parameter with logical ``axes`` in ``tp``'s stored layout:
    q/k/v and gate/up columns reordered shard by shard (KV columns copied), vocabulary padded with zeros."""
    if tp.size == 1:
        return value
    for dim, ax in enumerate(axes):
        if ax == QKV:
            value = jnp.take(value, jnp.asarray(tp.qkv_columns()), axis=dim)
        elif ax == GATE_UP:
            value = jnp.take(value, jnp.asarray(tp.gate_up_columns()), axis=dim)
        elif ax == VOCAB:
            pad = [(0, 0)] * value.ndim
            pad[dim] = (0, tp.vocab_padded - value.shape[dim])
            value = jnp.pad(value, pad)
    return value


def from_layout(tp: TensorParallel, axes: Sequence[str | None], value: jax.Array) -> np.ndarray:
    """The inverse of :func:`to_layout` (host NumPy): a stored array back in the checkpoint's order."""
    value = np.asarray(value)
    if tp.size == 1:
        return value
    for dim, ax in enumerate(axes):
        if ax in (QKV, GATE_UP):
            cols = tp.qkv_columns() if ax == QKV else tp.gate_up_columns()
            _, first = np.unique(cols, return_index=True)  # one copy of each replicated KV column
            value = np.take(value, first, axis=dim)
        elif ax == VOCAB:
            value = np.take(value, np.arange(tp.vocab_size), axis=dim)
    return value


def param_axes(var: nnx.Variable) -> tuple:
    """The logical axes a parameter (an ``nnx.Variable``) was created with (None each if it has none)."""
    return tuple(var.get_metadata().get("axes") or (None,) * var.ndim)


def partition_spec(tp: TensorParallel | None, axes: Sequence[str | None]) -> P:
    """The PartitionSpec of a parameter with logical ``axes`` (all replicated at size 1 or without a
    layout: a replicated module such as the EAGLE draft)."""
    if tp is None or tp.size == 1:
        return REPLICATED
    return P(*(AXIS if ax in SHARDED else None for ax in axes))


def state_specs(state: nnx.State, tp: TensorParallel | None) -> nnx.State:
    """``state`` (a module's ``nnx.split`` state) with every variable's value replaced by its PartitionSpec
    (a pytree ``shard_map`` and ``jax.jit`` take as specs)."""
    return jax.tree.map(lambda v: v.replace(partition_spec(tp, param_axes(v))), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def cache_specs(cache) -> object:
    """PartitionSpecs of a cache (the same dataclass): a :class:`~minicpm_jax.model.cache.KVCache`'s K/V and
    compressed keys ``[L, B, KVH, N, D]``, or a :class:`~minicpm_jax.model.paged_cache.PagedKVCache`'s pools
    ``[L, KVH, slots, D]`` (compressed keys alike), split on their heads; lengths and page tables replicated."""
    if isinstance(cache, PagedKVCache):
        heads = P(None, AXIS)
        return dataclasses.replace(cache, k=heads, v=heads, page_table=REPLICATED, lengths=REPLICATED,
                                   tree_base=REPLICATED, k1=None if cache.k1 is None else heads,
                                   k2=None if cache.k2 is None else heads)
    heads = P(None, None, AXIS)
    return dataclasses.replace(cache, k=heads, v=heads, lengths=REPLICATED,
                               k1=None if cache.k1 is None else heads, k2=None if cache.k2 is None else heads)


# ------------------------------------------------------------------------------------------ placement
def make_mesh(size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh (:data:`AXIS`) of the first ``size`` devices (all processes' devices, in
    ``jax.devices()`` order); MiniCPMError if there are fewer."""
    devices = list(devices if devices is not None else jax.devices())
    if size < 1 or size > len(devices):
        kind = f"{devices[0].platform} " if devices else ""
        raise MiniCPMError(f"tensor parallelism over {size} devices, but {len(devices)} {kind}device(s) are visible")
    return Mesh(np.array(devices[:size]), (AXIS,))


_PEER_MESHES: dict[tuple[int, ...], PeerWorkspace] = {}


def use_peer_all_reduce(mesh: Mesh, enable: bool = True) -> PeerWorkspace | None:
    """Gives ``mesh``'s devices a peer-memory workspace, so models built on them afterwards reduce their
    sublayers through the pallas backend's all-reduce kernel (``--tp_all_reduce peer``); ``enable=False``
    takes that back for models built afterwards (the workspace stays allocated). MiniCPMError when the
    devices cannot (not all GPUs of this process, or no peer access between them)."""
    devices = list(mesh.devices.flat)
    if not enable:
        _PEER_MESHES.pop(tuple(d.id for d in devices), None)
        return None
    try:
        workspace = allocate_workspace(devices)
    except PeerAccessError as e:
        raise MiniCPMError(f"--tp_all_reduce peer: {e}") from None
    _PEER_MESHES[tuple(d.id for d in devices)] = workspace
    return workspace


def set_all_reduce(mesh: Mesh, choice: str) -> str | None:
    """Applies ``--tp_all_reduce``'s ``choice`` to ``mesh``: ``peer`` gives it a peer-memory workspace
    (:func:`use_peer_all_reduce`; MiniCPMError when it cannot), ``auto`` does so where every device is a GPU
    and falls back to XLA's all-reduce when that fails, ``xla`` / ``nccl`` leave XLA's. Returns a note for
    the user when ``auto`` fell back, else None."""
    if choice == "peer":
        use_peer_all_reduce(mesh)
    elif choice == "auto" and all(d.platform == "gpu" for d in mesh.devices.flat):
        try:
            use_peer_all_reduce(mesh)
        except MiniCPMError as e:
            return f"{e}; the split model reduces through XLA's all-reduce"
    return None


def peer_workspace(mesh: Mesh | AbstractMesh | None) -> PeerWorkspace | None:
    """The workspace :func:`use_peer_all_reduce` gave ``mesh``'s devices, or None."""
    if not isinstance(mesh, Mesh):
        return None
    return _PEER_MESHES.get(tuple(d.id for d in mesh.devices.flat))


def mesh_size(mesh: Mesh | None) -> int:
    """Devices on the tensor-parallel axis (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[AXIS])


def place(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``value`` as a global array with ``sharding``; with several processes each builds its own
    devices' blocks from its (identical) host copy."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicate(mesh: Mesh | None, tree):
    """Every array of ``tree`` replicated over ``mesh`` (unchanged without a mesh)."""
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, REPLICATED)
    return jax.tree.map(lambda x: place(x, sharding), tree)


def allocate(mesh: Mesh | None, make: Callable[[], object], specs: Callable[[object], object]):
    """``make()`` (a pytree of new arrays, e.g. an empty cache) created directly in the shardings
    ``specs(tree)`` gives, without a single-device copy first."""
    if mesh is None:
        return make()
    shape = jax.eval_shape(make)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(shape), is_leaf=lambda x: isinstance(x, P))
    return jax.jit(make, out_shardings=shardings)()


def spmd(mesh: Mesh | None, fn: Callable, in_specs, out_specs) -> Callable:
    """``fn`` run as one SPMD program over ``mesh``: every device gets its blocks of the arguments
    (``in_specs``, a pytree prefix of them) and returns its blocks of the results (``out_specs``, or a
    function of the static arguments giving them, where those change what ``fn`` returns); keyword
    arguments are static. Without a mesh, ``fn`` itself."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def run(*args, **static):
        body = functools.partial(fn, **static)
        outs = out_specs(**static) if callable(out_specs) else out_specs
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=outs, check_vma=False)(*args)

    return run
