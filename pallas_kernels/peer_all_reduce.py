"""A one-shot all-reduce through peer memory, as a plain Pallas (Triton) kernel XLA records in its CUDA graphs.

Why: XLA runs its own collectives (NCCL, or its one-shot kernel) as thunks between command buffers, so a
split decode step is ~65 CUDA graphs launched from the host around ~65 collective thunks, and the host
sets the pace (docs/lab_notes, twenty-fifth and thirtieth sessions). This kernel is an ordinary custom
call to XLA: a whole step with its all-reduces is one graph. It is the custom all-reduce of vLLM and SGLang
(one-shot, for small messages), on the single-process JAX runtime, where every GPU of the mesh shares one
address space and peer access is on.

Protocol (NCCL's "LL"): each device owns a workspace (:class:`PeerWorkspace`, allocated once, at a fixed
address the kernel gets as a constant table). Program ``p`` of rank ``r`` handles ``TILE`` elements: it
reads its call counter ``e - 1`` from its own workspace, then stores each fp32 value together with the flag
``e`` as one 8-byte word (``{bits, e}``, a single access: no fence needed) into slot ``(e & 1, r)`` of every
peer's workspace; then it polls its own slots ``(e & 1, s)`` for every other rank ``s`` until every flag
reads ``e``, sums the ranks' values in rank order (the same order on every rank: the replicas stay
bit-identical; for 2 ranks it is ``psum``'s result bit for bit) and stores ``e`` as its counter. Two slots,
chosen by the parity of ``e``, make overwriting safe: a rank writes a slot again at ``e + 2`` only after it
finished call ``e + 1``, which needed every peer's ``e + 1`` values, which each peer stores after it
finished reading call ``e``. Every rank runs the same calls in the same order (one SPMD program), so the
counters stay equal, and one at a time: XLA runs a program's kernels in order on one stream and records its
command buffers in that order. A mode that runs independent kernels side by side
(``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``) would let two independent calls (a speculative round's
logits gather and its draft's embedding lookup, say) race on the counters. No multicast object, no NVLink SHARP:
plain loads and stores to peer memory.

The loads and stores are inline PTX (``ld/st.volatile.global.v2.u32``, i.e. relaxed at system scope)
through :data:`_asm_p`, a non-pure version of Pallas' ``elementwise_inline_asm`` (whose asm is pure, so
LLVM could hoist a polling load out of its loop or drop a store): the one piece of this module that
reaches into Pallas' Triton lowering.

Shapes: ``x [..., H]`` fp32 (any shape; flattened), at most :data:`MAX_ELEMENTS` elements; the result has
``x``'s shape and dtype. The reference is ``lax.psum(x, axis_name)``. It needs a GPU: no interpret mode
(there is no peer memory to emulate); CPU tests check the lowered kernel, GPU tests the results.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.core import ShapedArray
from jax.extend.core import Primitive

from pallas_kernels.matmul import SplitSum, as_split

# Elements per program (4 KB of LL words pushed to each peer). Half the 1,024 of the first version: a batch-16
# TP 2 decode step (16 x 4,096 fp32 messages) ran 5.5% faster with twice the programs (2x H200, 2026-11-30,
# alternating processes; docs/lab_notes/2026-11-30-forty-seventh-session.md).
TILE = 512
MAX_PROGRAMS = 512  # programs per call: co-resident on an H100/H200 (every program polls for its peers')
MAX_ELEMENTS = TILE * MAX_PROGRAMS  # the largest message (256K fp32; a batch of 64 rows of 4096)
# The fused all-reduce + residual add + RMSNorm (:func:`peer_all_reduce_add_norm`) works in rows:
ROW_WORDS = 8192  # the widest row (a row's place in the workspace: ``row * ROW_WORDS``)
MAX_ROWS = MAX_ELEMENTS // ROW_WORDS  # rows per call (32)
# Elements and warps a program (a row's programs then trade their sums of squares), for a lone row (batch-1 decode)
# and for several rows (measured at 16; other counts take the same). One row: 512, not the first version's 1,024
# (TP 2 decode 2.851 -> 2.785 ms/token); one program a row (4,096 elements, 16 or 32 warps: 3.02, 2.97) or 2,048
# (2.85) lost to 512 (2.75-2.77). 16 rows: 256 (3.349 -> 3.246 ms a step in one call; in the next 256 3.27-3.30,
# 128 3.28, 256 with 2 warps 3.30-3.31). 2x H200, one process a variant, alternating (lab note of 2026-12-01).
ONE_ROW_TILE, ONE_ROW_WARPS = 512, 4
ROW_TILE, ROW_WARPS = 256, 4
MAX_TILES = ROW_WORDS // min(ROW_TILE, ONE_ROW_TILE)  # counters a row (32)
_ROW_COUNTERS = MAX_PROGRAMS  # first word of the rows' counters (after the flat kernel's)
_ROW_PARTIALS = _ROW_COUNTERS + MAX_ROWS * MAX_TILES  # first word of the rows' programs' sums of squares
_COUNTERS = _ROW_PARTIALS + MAX_ROWS * MAX_TILES  # counter-like words in all; the slots follow
_WORD = 8  # bytes of one LL word: {fp32 bits, flag}
# K-split parts (``SplitSum``) the fused kernel adds as it reads them; more (or a count not a power of 2) are added
# by XLA first (each program reads its tile of every part: 32 int4 down_proj parts would be 128 KB a program).
MAX_PARTS = 8


# ------------------------------------------------------------------------------------ the inline asm
_asm_p = Primitive("minicpm_volatile_asm")
_asm_p.multiple_results = True


@_asm_p.def_abstract_eval
def _asm_abstract_eval(*avals, asm, constraints, n_out):
    del asm, constraints
    return [ShapedArray(avals[0].shape, jnp.uint32) for _ in range(n_out)]


def _asm_lowering(ctx, *args, asm, constraints, n_out):
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering

    results = tt_dialect.elementwise_inline_asm(
        [ir.RankedTensorType.get(aval.shape, lowering._dtype_to_ir_type(aval.dtype)) for aval in ctx.avals_out], asm,
        constraints=constraints, pure=False, packed_element=1, args=list(args))
    return [results] if n_out == 1 else list(results)


def _register_lowering() -> None:
    from jax._src.pallas.triton import lowering

    lowering.triton_lowering_rules[_asm_p] = _asm_lowering


_register_lowering()


def _asm(asm: str, constraints: str, n_out: int, *args: jax.Array) -> list[jax.Array]:
    """Non-pure elementwise inline PTX over uint32 ``args`` (same shape) → ``n_out`` uint32 arrays."""
    return _asm_p.bind(*[a.astype(jnp.uint32) for a in args], asm=asm, constraints=constraints, n_out=n_out)


# $1 hi, $2 lo (the workspace's address), $3 word offset, $4 value bits, $5 flag, $6 predicate → $0 = $4.
_STORE = """{
.reg .b64 %wa;
.reg .pred %wp;
setp.ne.u32 %wp, $6, 0;
mov.b64 %wa, {$2, $1};
mad.wide.u32 %wa, $3, 8, %wa;
@%wp st.volatile.global.v2.u32 [%wa], {$4, $5};
mov.b32 $0, $4;
}"""
# $2 hi, $3 lo, $4 word offset → $0 value bits, $1 flag.
_LOAD = """{
.reg .b64 %wa;
mov.b64 %wa, {$3, $2};
mad.wide.u32 %wa, $4, 8, %wa;
ld.volatile.global.v2.u32 {$0, $1}, [%wa];
}"""


def _store(hi, lo, offsets, bits, flag, pred):
    return _asm(_STORE, "=r,r,r,r,r,r,r", 1, hi, lo, offsets, bits, flag, pred)[0]


def _load(hi, lo, offsets):
    return _asm(_LOAD, "=r,=r,r,r,r", 2, hi, lo, offsets)


# ------------------------------------------------------------------------------------ the workspace
@dataclasses.dataclass(frozen=True)
class PeerWorkspace:
    """Each rank's workspace address, ``addresses[r]`` (rank ``r`` = position on the mesh axis), as a
    hashable static argument. Word layout of one workspace (8-byte words): ``[0, MAX_PROGRAMS)`` the
    programs' call counters of :func:`peer_all_reduce`, ``MAX_TILES`` counters for each of ``MAX_ROWS`` rows
    of :func:`peer_all_reduce_add_norm`, as many words for its programs' partial sums of squares, then each
    kernel's slots ``(parity, source rank)`` of :data:`MAX_ELEMENTS` words each."""

    addresses: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.addresses)

    def table(self) -> np.ndarray:
        """``uint32[rows, 2]``: each rank's address as ``(high, low)`` words, zero rows up to a power of 2
        (a Triton block's size)."""
        rows = 1 << (self.size - 1).bit_length()
        table = np.zeros((rows, 2), np.uint32)
        table[: self.size] = [(a >> 32, a & 0xFFFFFFFF) for a in self.addresses]
        return table

    @staticmethod
    def words(size: int) -> int:
        """8-byte words of one rank's workspace for ``size`` ranks."""
        return _COUNTERS + 4 * size * MAX_ELEMENTS


def _slot_offset(parity, source, size: int):
    """The first word of slot ``(parity, source)`` of :func:`peer_all_reduce`."""
    return _COUNTERS + (parity * size + source) * MAX_ELEMENTS


def _row_slot_offset(parity, source, size: int):
    """The first word of slot ``(parity, source)`` of :func:`peer_all_reduce_add_norm` (its own slots: a
    stale word of the other kernel could carry the flag it waits for)."""
    return _COUNTERS + (2 * size + parity * size + source) * MAX_ELEMENTS


class PeerAccessError(RuntimeError):
    """The devices cannot reach each other's memory."""


_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


def _enable_peer_access(devices: Sequence[jax.Device]) -> None:
    """Turns on peer access between every pair of ``devices`` in their primary CUDA contexts (the ones XLA
    uses), through the driver API; already enabled is fine. :class:`PeerAccessError` when a pair cannot."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PeerAccessError(f"the CUDA driver library is not loadable: {e}") from None

    def check(result, what):
        if result not in (0, _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            raise PeerAccessError(f"{what} failed with CUDA error {result}")

    ordinals = [d.local_hardware_id for d in devices]
    handles, contexts = [], []
    for o in ordinals:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        check(cuda.cuDeviceGet(ctypes.byref(dev), o), f"cuDeviceGet({o})")
        check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuDevicePrimaryCtxRetain({o})")
        handles.append(dev)
        contexts.append(ctx)
    previous = ctypes.c_void_p()
    check(cuda.cuCtxGetCurrent(ctypes.byref(previous)), "cuCtxGetCurrent")
    try:
        for i, ctx in enumerate(contexts):
            check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            for j, peer in enumerate(contexts):
                if i == j:
                    continue
                can = ctypes.c_int()
                check(cuda.cuDeviceCanAccessPeer(ctypes.byref(can), handles[i], handles[j]), "cuDeviceCanAccessPeer")
                if not can.value:
                    raise PeerAccessError(f"GPU {ordinals[i]} cannot access GPU {ordinals[j]}'s memory")
                check(cuda.cuCtxEnablePeerAccess(peer, 0), f"cuCtxEnablePeerAccess({ordinals[i]} -> {ordinals[j]})")
    finally:
        cuda.cuCtxSetCurrent(previous)


_KEEP_ALIVE: dict[tuple[int, ...], tuple[PeerWorkspace, list[jax.Array]]] = {}


def allocate_workspace(devices: Sequence[jax.Device]) -> PeerWorkspace:
    """The workspace of ``devices`` (the mesh axis' devices, in rank order): zeroed device buffers, kept
    alive for the life of the process (the kernel writes them behind XLA's back, at fixed addresses); one
    per device set. Needs every device in this process, on NVIDIA GPUs that can reach each other's memory
    (:class:`PeerAccessError` otherwise)."""
    key = tuple(d.id for d in devices)
    if key in _KEEP_ALIVE:
        return _KEEP_ALIVE[key][0]
    if any(d.platform != "gpu" or d.process_index != jax.process_index() for d in devices):
        raise PeerAccessError("the peer-memory all-reduce needs every device of the mesh to be a GPU of this process")
    _enable_peer_access(devices)
    words = PeerWorkspace.words(len(devices))
    buffers = [jax.device_put(np.zeros(2 * words, np.uint32), d) for d in devices]
    for b in buffers:
        b.block_until_ready()
    workspace = PeerWorkspace(tuple(int(b.unsafe_buffer_pointer()) for b in buffers))
    _KEEP_ALIVE[key] = (workspace, buffers)
    return workspace


# ------------------------------------------------------------------------------------ the kernels
def _vector(value, width: int):
    return jnp.zeros((width,), jnp.uint32) + value


def _push(table_ref, rank, size: int, bits, words, epoch, pred):
    """Stores ``bits`` (with the flag ``epoch``, lanes ``pred``) at ``words`` of every peer's workspace; returns
    ``bits`` through the stores (so what uses them comes after)."""
    width = bits.shape[0]
    for step in range(1, size):
        peer = (rank + step) % size
        bits = _store(_vector(table_ref[peer, 0], width), _vector(table_ref[peer, 1], width), words, bits, epoch,
                      pred)
    return bits


def _poll(hi, lo, words, epoch, skip):
    """Loads ``words`` of this rank's workspace until every lane's flag is ``epoch`` (lanes ``skip``: never
    waited for); returns the value bits."""

    def waiting(state):
        _, flag = state
        return jnp.sum(jnp.where((flag == epoch) | skip, 0, 1)) > 0

    value, _ = lax.while_loop(waiting, lambda state: tuple(_load(hi, lo, words)), tuple(_load(hi, lo, words)))
    return value


def _kernel(table_ref, rank_ref, x_ref, o_ref, *, size: int, elements: int):
    p = pl.program_id(0)
    rank = rank_ref[0]
    lanes = jnp.arange(TILE, dtype=jnp.int32)
    inside = (p * TILE + lanes) < elements
    my_hi, my_lo = _vector(table_ref[rank, 0], TILE), _vector(table_ref[rank, 1], TILE)
    counter = _vector(p.astype(jnp.uint32), TILE)
    _, last = _load(my_hi, my_lo, counter)
    epoch = last + 1  # the same in every lane
    parity = epoch & 1
    word = (p * TILE + lanes).astype(jnp.uint32)
    bits = _push(table_ref, rank, size, lax.bitcast_convert_type(x_ref[...], jnp.uint32),
                 word + _slot_offset(parity, rank.astype(jnp.uint32), size), epoch, inside.astype(jnp.uint32))
    own = lax.bitcast_convert_type(bits, jnp.float32)
    total = None
    for source in range(size):  # sum in rank order
        value = _poll(my_hi, my_lo, word + _slot_offset(parity, jnp.uint32(source), size), epoch,
                      ~inside | (rank == source))
        v = jnp.where(rank == source, own, lax.bitcast_convert_type(value, jnp.float32))
        total = v if total is None else total + v
    # The counter, stored last (lane 0): the result depends on the store, so nothing drops it.
    kept = _store(my_hi, my_lo, counter, lax.bitcast_convert_type(total, jnp.uint32), epoch,
                  (lanes == 0).astype(jnp.uint32))
    o_ref[...] = lax.bitcast_convert_type(kept, jnp.float32)


def _traded_inv(table_ref, rank, row, j, tiles: int, h, epoch, width: int, eps: float):
    """``rsqrt(mean(row²) + eps)`` of program ``(row, j)``'s row, from every program's sum of squares over its tile
    ``h``: traded through this GPU's partial-sum words (one LL word each) and summed in tile order (the same order
    in every program and on every rank: the replicas stay identical)."""
    n = max(tiles, 16)  # lanes: a power of 2, at least Triton's smallest block
    k = jnp.arange(n, dtype=jnp.int32)
    k_hi, k_lo = _vector(table_ref[rank, 0], n), _vector(table_ref[rank, 1], n)
    k_epoch = _vector(jnp.max(epoch), n)
    k_words = (_ROW_PARTIALS + row * MAX_TILES + k).astype(jnp.uint32)
    mine = lax.bitcast_convert_type(
        _store(k_hi, k_lo, k_words, lax.bitcast_convert_type(_vector(0, n).astype(jnp.float32) + jnp.sum(h * h),
                                                               jnp.uint32),
               k_epoch, (k == j).astype(jnp.uint32)), jnp.float32)
    theirs = lax.bitcast_convert_type(_poll(k_hi, k_lo, k_words, k_epoch, (k >= tiles) | (k == j)), jnp.float32)
    squares = jnp.where(k == j, mine, jnp.where(k < tiles, theirs, 0.0))
    return lax.rsqrt(jnp.sum(squares) / width + eps)


def _add_norm_kernel(table_ref, rank_ref, x_ref, r_ref, w_ref, h_ref, n_ref, *, size: int, width: int,
                     scale: float, eps: float):
    """Program ``(row, j)`` of a ``(rows, width // tile)`` grid; the refs are tile ``j`` of the row (``x_ref``:
    of each split part, ``[S, tile]``). It adds the parts in order, reduces its tile as :func:`_kernel` does, adds
    it to the residual, and trades its tile's sum of squares with the row's other programs on this GPU (one LL
    word each: this workspace's partial-sum words), for the norm."""
    row, j = pl.program_id(0), pl.program_id(1)
    rank = rank_ref[0]
    tile = x_ref.shape[-1]
    tiles = width // tile
    hi, lo = _vector(table_ref[rank, 0], tile), _vector(table_ref[rank, 1], tile)
    lanes = jnp.arange(tile, dtype=jnp.int32)
    counter_base = _ROW_COUNTERS + row * MAX_TILES
    _, last = _load(hi, lo, _vector((counter_base + j).astype(jnp.uint32), tile))
    epoch = last + 1  # every counter of a row holds the same count (see the end)
    parity = epoch & 1
    word = (row * ROW_WORDS + j * tile + lanes).astype(jnp.uint32)
    x = x_ref[0]
    for s in range(1, x_ref.shape[0]):  # the split parts, in order
        x = x + x_ref[s]
    bits = _push(table_ref, rank, size, lax.bitcast_convert_type(x, jnp.uint32),
                 word + _row_slot_offset(parity, rank.astype(jnp.uint32), size), epoch, _vector(1, tile))
    own = lax.bitcast_convert_type(bits, jnp.float32)
    total = None
    for source in range(size):  # sum in rank order
        value = _poll(hi, lo, word + _row_slot_offset(parity, jnp.uint32(source), size), epoch,
                      jnp.zeros((tile,), jnp.bool_) | (rank == source))
        v = jnp.where(rank == source, own, lax.bitcast_convert_type(value, jnp.float32))
        total = v if total is None else total + v
    dt = r_ref.dtype
    # The reference's formula: the sum cast to dt, scaled and added in dt (Triton may contract the two into one
    # FMA where XLA rounds twice: equal to the reference within dt's rounding, identical on every rank).
    h = (r_ref[...] + total.astype(dt) * jnp.asarray(scale, dt)).astype(jnp.float32)
    if tiles == 1:  # the whole row in this program: no trade
        inv = lax.rsqrt(jnp.sum(h * h) / width + eps)
    else:
        inv = _traded_inv(table_ref, rank, row, j, tiles, h, epoch, width, eps)
    # The counters, stored last: this program's, and the row's counters past the grid's tiles (j + m * tiles),
    # so every counter of a row moves together whatever the width of a call, and the epoch a program reads
    # is the one its peers' programs of the row use. The value stored is h, so the outputs wait for it.
    spare = j + lanes * tiles
    kept = _store(hi, lo, (counter_base + spare).astype(jnp.uint32), lax.bitcast_convert_type(h, jnp.uint32),
                  epoch, (spare < MAX_TILES).astype(jnp.uint32))
    h = lax.bitcast_convert_type(kept, jnp.float32)
    h_ref[...] = h.astype(dt)
    n_ref[...] = (h * inv).astype(dt) * w_ref[...].astype(dt)


def peer_all_reduce(x: jax.Array, workspace: PeerWorkspace, axis_name: Hashable) -> jax.Array:
    """``lax.psum(x, axis_name)`` for an fp32 ``x`` of at most :data:`MAX_ELEMENTS` elements, through
    ``workspace`` (the axis' devices' :func:`allocate_workspace`). Call inside ``shard_map`` over the axis."""
    from jax.experimental.pallas import triton as plt

    if x.dtype != jnp.float32:
        raise TypeError(f"peer_all_reduce sums fp32 partials, got {x.dtype}")
    n = x.size
    if n > MAX_ELEMENTS:
        raise ValueError(f"peer_all_reduce takes at most {MAX_ELEMENTS} elements, got {n}")
    programs = -(-n // TILE)
    flat = x.reshape(n)
    if programs * TILE != n:
        flat = jnp.pad(flat, (0, programs * TILE - n))
    rank = lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    table = workspace.table()
    out = pl.pallas_call(
        functools.partial(_kernel, size=workspace.size, elements=n),
        grid=(programs,),
        in_specs=[pl.BlockSpec(table.shape, lambda i: (0, 0)), pl.BlockSpec((1,), lambda i: (0,)),
                  pl.BlockSpec((TILE,), lambda i: (i,))],
        out_specs=pl.BlockSpec((TILE,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((programs * TILE,), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name="peer_all_reduce",
    )(jnp.asarray(table), rank, flat)
    return out[:n].reshape(x.shape)


def row_tiling(rows: int, width: int) -> tuple[int, int]:
    """``(elements, warps)`` of each program of :func:`peer_all_reduce_add_norm` over ``rows`` rows of ``width``:
    a lone row's tiling or the several rows' one (the constants above), at most the whole row."""
    tile, warps = (ONE_ROW_TILE, ONE_ROW_WARPS) if rows == 1 else (ROW_TILE, ROW_WARPS)
    return min(tile, width), warps


def fits_rows(x: jax.Array | SplitSum, workspace: PeerWorkspace | None) -> bool:
    """Whether :func:`peer_all_reduce_add_norm` takes partial sums ``x [..., H]`` (or a ``SplitSum`` of them):
    a workspace, fp32, ``H`` a power of 2 from 16 to :data:`ROW_WORDS` (tiles of :func:`row_tiling`), at
    most :data:`MAX_ROWS` rows (so at most ``MAX_PROGRAMS`` programs and ``MAX_ELEMENTS`` elements, as
    :func:`peer_all_reduce`)."""
    if not isinstance(x, SplitSum) and x.ndim == 0:
        return False
    x = as_split(x)
    width = x.shape[-1]
    return (workspace is not None and x.parts.dtype == jnp.float32 and 16 <= width <= ROW_WORDS
            and width & (width - 1) == 0 and x.rows <= MAX_ROWS)


def peer_all_reduce_add_norm(partial: jax.Array | SplitSum, residual: jax.Array, scale: float, weight: jax.Array, *,
                             eps: float, workspace: PeerWorkspace,
                             axis_name: Hashable) -> tuple[jax.Array, jax.Array]:
    """One kernel for ``h = residual + psum(partial).astype(dt) * scale`` and ``rms_norm(h, weight)``
    (``pallas_kernels.residual``'s reference ops, the sum through peer memory as :func:`peer_all_reduce`):
    ``partial [..., H]`` fp32 (:func:`fits_rows`), or a :class:`~pallas_kernels.matmul.SplitSum` of it whose
    parts each program adds first (the split-K GEMM's own reduction, a kernel less; beyond :data:`MAX_PARTS`
    parts, or not a power of 2, XLA adds them before the kernel); ``residual [..., H]`` in
    dt, ``weight [H]`` → ``(h, normed)`` in dt. A row is split over ``H / tile`` programs (:func:`row_tiling`),
    each reducing its tile as :func:`peer_all_reduce` does (one program a row, or every program polling the whole
    row, was slower, 2026-11-28 and 2026-12-01), which trade their tiles' sums of squares on the GPU (a program
    that holds the whole row, ``H`` at most one tile, trades nothing). Call inside ``shard_map``."""
    from jax.experimental.pallas import triton as plt

    if not fits_rows(partial, workspace):
        parts = partial.parts if isinstance(partial, SplitSum) else partial
        raise ValueError(f"peer_all_reduce_add_norm takes fp32 rows of a power-of-2 width up to {ROW_WORDS}, at "
                         f"most {MAX_ROWS} of them; got {parts.dtype} {parts.shape}")
    partial = as_split(partial)
    splits = partial.parts.shape[0]
    if splits > MAX_PARTS or splits & (splits - 1):
        partial, splits = SplitSum.whole(partial.total()), 1
    width, rows = partial.shape[-1], partial.rows
    tile, warps = row_tiling(rows, width)
    table = workspace.table()
    block = pl.BlockSpec((None, tile), lambda i, j: (i, j))
    h, normed = pl.pallas_call(
        functools.partial(_add_norm_kernel, size=workspace.size, width=width, scale=scale, eps=eps),
        grid=(rows, width // tile),
        in_specs=[pl.BlockSpec(table.shape, lambda i, j: (0, 0)), pl.BlockSpec((1,), lambda i, j: (0,)),
                  pl.BlockSpec((splits, None, tile), lambda i, j: (0, i, j)), block,
                  pl.BlockSpec((tile,), lambda i, j: (j,))],
        out_specs=[block, block],
        out_shape=[jax.ShapeDtypeStruct((rows, width), residual.dtype)] * 2,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        name="peer_all_reduce_add_norm",
    )(jnp.asarray(table), lax.axis_index(axis_name).astype(jnp.int32).reshape(1), partial.parts,
      residual.reshape(rows, width), weight)
    return h.reshape(residual.shape), normed.reshape(residual.shape)
