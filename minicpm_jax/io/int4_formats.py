"""int4 weight formats (host-side NumPy): GPTQ packing, the Marlin tile permutation (of CPM.cu's
marlin-cpmcu checkpoints), and the engine's in-memory layout.

Conventions: a weight is ``[K, N]`` = ``[in_features, out_features]``; unsigned 4-bit codes ``q`` in
[0, 15]; groups of ``group_size`` consecutive input rows share a scale ``s`` and a zero point ``z`` per
output column; ``w = s · (q − z)``. Symmetric checkpoints have ``z = 8`` everywhere (Marlin's ``uint4b8``).

Formats:

* **GPTQ** (AutoGPTQ / GPTQModel / transformers): ``qweight int32 [K/8, N]`` packs 8 consecutive K rows,
  lowest nibble first; ``qzeros int32 [G, N/8]`` packs 8 consecutive columns; ``scales fp16 [G, N]``;
  ``g_idx int32 [K]`` (act-order). Format ``gptq`` (v1) stores ``z − 1``; ``gptq_v2`` stores ``z``.
* **Marlin** (IST-DASLab, vLLM, CPM.cu's marlin-cpmcu): ``qweight int32 [K/16, 2N]``: the codes of each
  16×64 tile shuffled into mma.m16n8k16 B-fragment order with the nibble interleave [0,2,4,6,1,3,5,7];
  scales ``[G, N]`` permuted inside each 64-column chunk (an 8×8 transpose), or inside 32-column chunks
  for per-channel scales.
* **Engine** (what :class:`minicpm_jax.model.layers.Int4Linear` holds): ``qweight int32 [K/8, N]``
  (GPTQ-native words, rows sorted by group), ``scales [G, N]`` and optional ``zeros [G, N]`` (absent when
  symmetric), optional ``perm int32 [K]`` (act-order: the activations are gathered by ``perm``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minicpm_jax.errors import MiniCPMError

BITS = 4
MAXQ = 15
SYM_ZERO = 8
_MARLIN_SCALE_GROUPED = np.array([i + 8 * j for i in range(8) for j in range(8)])  # 8×8 transpose
_MARLIN_SCALE_SINGLE = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])


# --------------------------------------------------------------------------------------- nibble packing
def pack_rows(q: np.ndarray) -> np.ndarray:
    """``q [K, N]`` codes → ``int32 [K/8, N]``, 8 consecutive rows per word, lowest nibble first."""
    k, n = q.shape
    if k % 8:
        raise MiniCPMError(f"cannot pack {k} rows into int32 words: K must be a multiple of 8")
    words = q.astype(np.uint32).reshape(k // 8, 8, n) << (4 * np.arange(8, dtype=np.uint32))[None, :, None]
    return np.bitwise_or.reduce(words, axis=1).view(np.int32)


def unpack_rows(packed: np.ndarray) -> np.ndarray:
    """``int32 [K/8, N]`` → ``uint8 [K, N]`` (inverse of :func:`pack_rows`)."""
    words = packed.astype(np.int32).view(np.uint32)
    nib = (words[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[None, :, None]) & 0xF
    return nib.reshape(-1, packed.shape[1]).astype(np.uint8)


def pack_cols(z: np.ndarray) -> np.ndarray:
    """``z [G, N]`` codes → ``int32 [G, N/8]``, 8 consecutive columns per word (GPTQ ``qzeros``)."""
    return pack_rows(z.T).T.copy()


def unpack_cols(packed: np.ndarray) -> np.ndarray:
    """``int32 [G, N/8]`` → ``uint8 [G, N]`` (inverse of :func:`pack_cols`)."""
    return unpack_rows(packed.T.copy()).T.copy()


# ------------------------------------------------------------------------------------------------ Marlin
def _check_marlin_shape(k: int, n: int) -> None:
    if k % 16 or n % 64:
        raise MiniCPMError(f"the Marlin layout needs K % 16 == 0 and N % 64 == 0, got K={k}, N={n}")


def marlin_pack(q: np.ndarray) -> np.ndarray:
    """``q [K, N]`` codes → Marlin ``int32 [K/16, 2N]``.

    Row k = 16·kt + 8·h + 2·t + i and column n = 64·c + 16·j + 8·b + l (h, i, b ∈ {0,1}; t, j ∈ 0..3;
    l ∈ 0..7) go to word ``[kt, 128·c + 16·l + 4·t + j]``, nibble ``4·i + 2·b + h``.
    """
    k, n = q.shape
    _check_marlin_shape(k, n)
    # axes of the reshape: kt, h, t, i, c, j, b, l
    tiles = q.astype(np.uint32).reshape(k // 16, 2, 4, 2, n // 64, 4, 2, 8)
    # to kt, c, l, t, j | i, b, h (the last three make the nibble index)
    nib = tiles.transpose(0, 4, 7, 2, 5, 3, 6, 1).reshape(k // 16, 2 * n, 8)
    return np.bitwise_or.reduce(nib << (4 * np.arange(8, dtype=np.uint32)), axis=2).view(np.int32)


def marlin_unpack(packed: np.ndarray) -> np.ndarray:
    """Marlin ``int32 [K/16, 2N]`` → ``uint8 [K, N]`` (inverse of :func:`marlin_pack`)."""
    kt, n2 = packed.shape
    words = packed.astype(np.int32).view(np.uint32)
    nib = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    tiles = nib.reshape(kt, n2 // 128, 8, 4, 4, 2, 2, 2)  # kt, c, l, t, j, i, b, h
    return tiles.transpose(0, 7, 3, 5, 1, 4, 6, 2).reshape(16 * kt, n2 // 2).astype(np.uint8)


def _check_scale_cols(n: int, chunk: int) -> None:
    if n % chunk:
        raise MiniCPMError(f"Marlin scales need a multiple of {chunk} columns, got {n}")


def marlin_permute_scales(scales: np.ndarray, per_channel: bool) -> np.ndarray:
    """``[G, N]`` scales (or zero points) → Marlin order: an 8×8 transpose inside each 64-column chunk,
    or, for one group over all of K (``per_channel``: Marlin's rule is ``G == 1``, whatever the group
    size was called), Marlin's 32-column ``scale_perm_single`` shuffle."""
    perm = _MARLIN_SCALE_SINGLE if per_channel else _MARLIN_SCALE_GROUPED
    g, n = scales.shape
    _check_scale_cols(n, perm.size)
    return np.ascontiguousarray(scales.reshape(-1, perm.size)[:, perm].reshape(g, n))


def marlin_unpermute_scales(scales: np.ndarray, per_channel: bool) -> np.ndarray:
    """Inverse of :func:`marlin_permute_scales`."""
    perm = _MARLIN_SCALE_SINGLE if per_channel else _MARLIN_SCALE_GROUPED
    g, n = scales.shape
    _check_scale_cols(n, perm.size)
    return np.ascontiguousarray(scales.reshape(-1, perm.size)[:, np.argsort(perm)].reshape(g, n))


# -------------------------------------------------------------------------------------------------- GPTQ
@dataclasses.dataclass
class Int4Weight:
    """One quantized matrix in plain form (host NumPy), the hub between all formats.

    q: ``uint8 [K, N]`` codes in the original row order; scales: ``float32 [G, N]``; zeros: ``float32
    [G, N]`` (true zero points) or None for symmetric (z = 8); g_idx: ``int32 [K]`` group of each row;
    group_size: rows per group (K for per-channel).
    """

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    g_idx: np.ndarray
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """``float32 [K, N]``: ``s[g_idx[k], n] · (q[k, n] − z[g_idx[k], n])``."""
        z = SYM_ZERO if self.zeros is None else self.zeros[self.g_idx]
        return self.scales[self.g_idx] * (self.q.astype(np.float32) - z)

    @property
    def trivial_g_idx(self) -> bool:
        return bool(np.array_equal(self.g_idx, np.arange(self.q.shape[0]) // self.group_size))


def gptq_unpack(
    qweight: np.ndarray,
    qzeros: np.ndarray | None,
    scales: np.ndarray,
    g_idx: np.ndarray | None,
    *,
    group_size: int,
    sym: bool,
    checkpoint_format: str = "gptq",
    name: str = "",
) -> Int4Weight:
    """GPTQ tensors of one linear (``qweight [K/8, N]``, ``qzeros [G, N/8]``, ``scales [G, N]``,
    ``g_idx [K]``) → :class:`Int4Weight`. v1 (``gptq``) zero points are stored minus one and read back
    as ``stored + 1`` (as AutoGPTQ's kernels do); ``gptq_v2`` stores them as they are. Symmetric
    checkpoints must hold z = 8 and are returned without zeros."""
    where = f" ({name})" if name else ""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise MiniCPMError(f"unsupported checkpoint_format {checkpoint_format!r}; expected 'gptq' or 'gptq_v2'")
    if qweight.dtype != np.int32 or qweight.ndim != 2:
        raise MiniCPMError(f"qweight{where} must be int32 [K/8, N], got {qweight.dtype} {list(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs:
        raise MiniCPMError(f"group_size {group_size} does not divide in_features {k}{where}")
    groups = k // gs
    if scales.shape != (groups, n):
        raise MiniCPMError(f"scales{where} has shape {list(scales.shape)}, expected {[groups, n]}")
    if g_idx is None:
        g_idx = np.arange(k, dtype=np.int32) // gs
    g_idx = np.asarray(g_idx).astype(np.int32)
    if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= groups:
        raise MiniCPMError(f"g_idx{where} must be [{k}] group indices below {groups}")
    zeros = None
    if qzeros is not None:
        if qzeros.shape != (groups, n // 8):
            raise MiniCPMError(f"qzeros{where} has shape {list(qzeros.shape)}, expected {[groups, n // 8]}")
        z = unpack_cols(qzeros).astype(np.float32)
        zeros = z + 1 if checkpoint_format == "gptq" else z
    if sym:
        if zeros is not None and not np.all(zeros == SYM_ZERO):
            raise MiniCPMError(f"qzeros{where} are not all {SYM_ZERO} although the config says sym=true")
        zeros = None
    elif zeros is None:
        raise MiniCPMError(f"missing qzeros{where}: an asymmetric (sym=false) checkpoint needs zero points")
    return Int4Weight(unpack_rows(qweight), scales.astype(np.float32), zeros, g_idx, gs)


def gptq_pack(w: Int4Weight, checkpoint_format: str = "gptq") -> dict[str, np.ndarray]:
    """:class:`Int4Weight` → GPTQ tensors ``{qweight, qzeros, scales (fp16), g_idx}`` (v1 by default)."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise MiniCPMError(f"unsupported checkpoint_format {checkpoint_format!r}; expected 'gptq' or 'gptq_v2'")
    z = np.full(w.scales.shape, SYM_ZERO, np.float32) if w.zeros is None else w.zeros
    z = np.rint(z).astype(np.int64) - (1 if checkpoint_format == "gptq" else 0)
    if z.min() < 0 or z.max() > MAXQ:
        raise MiniCPMError(
            f"zero points outside what checkpoint_format {checkpoint_format!r} can store (v1 stores z - 1 in 4 "
            "bits, so z = 0 is lost); write checkpoint_format 'gptq_v2'"
        )
    return {
        "qweight": pack_rows(w.q),
        "qzeros": pack_cols((z & 0xF).astype(np.uint8)),
        "scales": w.scales.astype(np.float16),
        "g_idx": w.g_idx.astype(np.int32),
    }


def sort_by_group(w: Int4Weight) -> tuple[Int4Weight, np.ndarray | None]:
    """Act-order folding: rows sorted by group so each group is one contiguous block of ``group_size``
    rows. Returns (sorted weight with trivial g_idx, ``perm [K]`` to gather activations with, or None
    when already sorted). ``x[..., perm] @ sorted = x @ original``."""
    if w.trivial_g_idx:
        return w, None
    counts = np.bincount(w.g_idx, minlength=w.scales.shape[0])
    if not np.all(counts == w.group_size):
        raise MiniCPMError(
            f"g_idx puts {sorted(set(counts.tolist()))} rows in a group, not {w.group_size} each; "
            "this act-order layout cannot be folded into contiguous groups"
        )
    perm = np.argsort(w.g_idx, kind="stable").astype(np.int32)
    k = w.q.shape[0]
    return Int4Weight(w.q[perm], w.scales, w.zeros, np.arange(k, dtype=np.int32) // w.group_size, w.group_size), perm


def concat_columns(parts: list[Int4Weight]) -> Int4Weight:
    """Fuses matrices with the same input (q/k/v → qkv, gate/up → gate_up) along N."""
    if len({(p.group_size, p.q.shape[0]) for p in parts}) != 1 or not all(
        np.array_equal(p.g_idx, parts[0].g_idx) for p in parts
    ):
        raise MiniCPMError("fused projections must share in_features, group_size and g_idx")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = np.concatenate(
            [np.full(p.scales.shape, SYM_ZERO, np.float32) if p.zeros is None else p.zeros for p in parts], axis=1
        )
    return Int4Weight(
        np.concatenate([p.q for p in parts], axis=1),
        np.concatenate([p.scales for p in parts], axis=1),
        zeros,
        parts[0].g_idx,
        parts[0].group_size,
    )


def split_columns(w: Int4Weight, sizes: list[int]) -> list[Int4Weight]:
    """Inverse of :func:`concat_columns`."""
    cuts = np.cumsum(sizes)[:-1]
    qs, ss = np.split(w.q, cuts, axis=1), np.split(w.scales, cuts, axis=1)
    zs = [None] * len(sizes) if w.zeros is None else np.split(w.zeros, cuts, axis=1)
    return [Int4Weight(q, s, z, w.g_idx, w.group_size) for q, s, z in zip(qs, ss, zs)]


def group_grid(v, sym: bool, xp=np):
    """GPTQ's grid of the groups ``v [..., R, N]`` (R rows each): (scale, zero) float32 ``[..., N]``.

    min/max per group and column, widened to include 0; symmetric: ``z = 8``, ``s = 2·max|w| / 15``,
    except that, as in GPTQ, a symmetric group with no negative value gets ``s = max / 15`` (and clips
    its top half); an all-zero group gets the grid of [-1, 1]. ``xp``: ``np`` (exact IEEE float32, so
    NumPy or torch re-derivations agree bit for bit) or ``jnp`` (inside the jitted GPTQ sweep)."""
    lo = xp.minimum(v.min(axis=-2), 0.0)
    hi = xp.maximum(v.max(axis=-2), 0.0)
    if sym:
        hi = xp.maximum(-lo, hi)
        lo = xp.where(lo < 0, -hi, lo)
    flat = (lo == 0) & (hi == 0)
    lo, hi = xp.where(flat, -1.0, lo), xp.where(flat, 1.0, hi)
    scale = (hi - lo) / MAXQ
    zero = xp.full_like(scale, SYM_ZERO) if sym else xp.round(-lo / scale)
    return scale, zero


def rtn_quantize(w: np.ndarray, *, group_size: int, sym: bool = True) -> Int4Weight:
    """Round-to-nearest int4 of ``w float [K, N]`` on :func:`group_grid`'s grid of consecutive
    ``group_size``-row groups (-1: one group); codes ``clip(round(w / s) + z, 0, 15)``, half to even."""
    k, n = w.shape
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs:
        raise MiniCPMError(f"group_size {group_size} does not divide in_features {k}")
    v = w.astype(np.float32).reshape(k // gs, gs, n)
    scale, zero = group_grid(v, sym)
    q = np.clip(np.rint(v / scale[:, None]) + zero[:, None], 0, MAXQ).astype(np.uint8).reshape(k, n)
    g_idx = np.arange(k, dtype=np.int32) // gs
    return Int4Weight(q, scale.astype(np.float32), None if sym else zero.astype(np.float32), g_idx, gs)


# ------------------------------------------------------------------------------------ the engine layout
def to_engine(w: Int4Weight) -> dict[str, np.ndarray]:
    """:class:`Int4Weight` → the arrays of an int4 linear (host NumPy, float32 scales/zeros; the loader
    casts them to the model's scale dtype): ``qweight``, ``scales``, and ``zeros`` / ``perm`` if needed."""
    w, perm = sort_by_group(w)
    out: dict[str, np.ndarray] = {"qweight": pack_rows(w.q), "scales": w.scales}
    if w.zeros is not None:
        out["zeros"] = w.zeros
    if perm is not None:
        out["perm"] = perm
    return out


def from_engine(arrays: dict[str, np.ndarray], group_size: int) -> Int4Weight:
    """Inverse of :func:`to_engine` (act-order rows back in their original order, with ``g_idx`` restored)."""
    q = unpack_rows(np.asarray(arrays["qweight"]))
    scales = np.asarray(arrays["scales"], np.float32)
    zeros = None if "zeros" not in arrays else np.asarray(arrays["zeros"], np.float32)
    k = q.shape[0]
    g_idx = np.arange(k, dtype=np.int32) // group_size
    if "perm" in arrays:
        inv_perm = np.argsort(np.asarray(arrays["perm"]))
        q, g_idx = q[inv_perm], g_idx[inv_perm]
    return Int4Weight(q, scales, zeros, g_idx, group_size)
