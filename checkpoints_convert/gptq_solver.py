"""4-bit weight quantization: round-to-nearest (RTN) and GPTQ (Frantar et al., 2022), in JAX.

Conventions (other code relies on them):

* A weight is ``w: float32 [K, N]`` = [in_features, out_features] (the transpose of torch's
  ``nn.Linear.weight``).
* Groups run along K: ``group_size`` G divides K, or is -1 for one group of all K rows
  (per-channel). There are NG = K // G groups (1 for G = -1).
* Per (group, output column): ``scale float32 [NG, N]`` and ``zero uint8 [NG, N]``, the true zero
  point in [0, 15]. ``w_hat[k, n] = scale[g, n] * (q[k, n] - zero[g, n])`` with ``g = g_idx[k]``.
* Parameters of a set of values v (one group, one column): xmin = min(min(v), 0),
  xmax = max(max(v), 0); if sym, xmax = max(|xmin|, xmax) and xmin = -xmax where xmin < 0;
  xmin = -1, xmax = 1 where both are 0; scale = (xmax - xmin) / 15; zero = 8 if sym else
  round(-xmin / scale); q = clip(round(v / scale) + zero, 0, 15). Rounding is half-to-even.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax import lax

from minicpm_jax.io import int4_formats as int4
from minicpm_jax.errors import MiniCPMError

BITS = 4
MAXQ = 2**BITS - 1
_HIGHEST = lax.Precision.HIGHEST


@dataclass
class QuantizedWeight:
    """A 4-bit quantized ``[K, N]`` weight.

    Attributes:
        q: uint8 [K, N], codes in [0, 15], in the original row order.
        scale: float32 [NG, N].
        zero: uint8 [NG, N], true zero points in [0, 15].
        g_idx: int32 [K], the group of every input row k.
    """

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    g_idx: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 [K, N]: ``scale[g_idx] * (q - zero[g_idx])``."""
        zero = self.zero[self.g_idx].astype(np.float32)
        return (self.scale[self.g_idx] * (self.q.astype(np.float32) - zero)).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# The quantization grid
# --------------------------------------------------------------------------------------------------


def _quantize(v, scale, zero, xp=jnp):
    """Codes (float32, in [0, 15]) of ``v`` on the grid ``(scale, zero)``; half-to-even rounding."""
    return xp.clip(xp.round(v / scale) + zero, 0, MAXQ)


def _group_params_np(w: np.ndarray, g: int, sym: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) float32 [K // g, N] of the consecutive g-row groups of ``w float32 [K, N]``."""
    return int4.group_grid(w.reshape(w.shape[0] // g, g, w.shape[1]), sym)


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _as_weight(w) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or 0 in w.shape:
        raise MiniCPMError(f"expected a non-empty 2-D weight [K, N], got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise MiniCPMError("the weight contains NaN or infinite values; it cannot be quantized")
    return w


def _effective_group_size(group_size, k: int) -> int:
    """G (K for per-channel), after checking that ``group_size`` is -1 or a positive divisor of K."""
    if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool):
        raise MiniCPMError(f"group_size must be an integer, got {group_size!r}")
    if group_size == -1:
        return k
    if group_size <= 0 or k % group_size:
        raise MiniCPMError(
            f"group_size must be -1 (per-channel) or a positive divisor of in_features={k}, got {group_size}"
        )
    return int(group_size)


# --------------------------------------------------------------------------------------------------
# Round to nearest
# --------------------------------------------------------------------------------------------------


def rtn_quantize(w, *, group_size: int, sym: bool = True) -> QuantizedWeight:
    """Round-to-nearest 4-bit quantization of ``w float32 [K, N]`` (:func:`minicpm_jax.io.int4_formats.rtn_quantize`,
    checked and returned as a :class:`QuantizedWeight`); g_idx[k] = k // G."""
    w = _as_weight(w)
    r = int4.rtn_quantize(w, group_size=_effective_group_size(group_size, w.shape[0]), sym=sym)
    zero = np.full_like(r.scales, int4.SYM_ZERO) if r.zeros is None else r.zeros
    return QuantizedWeight(q=r.q, scale=r.scales, zero=zero.astype(np.uint8), g_idx=r.g_idx)


# --------------------------------------------------------------------------------------------------
# Hessian of the layer-wise objective
# --------------------------------------------------------------------------------------------------


@jax.jit
def _hessian_update(h: jax.Array, x: jax.Array, n_old: jax.Array, n_new: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return h * (n_old / n_new) + (2.0 / n_new) * jnp.matmul(x.T, x, precision=_HIGHEST)


@jax.jit
def _cross_update(c: jax.Array, x: jax.Array, x_ref: jax.Array, n_old: jax.Array, n_new: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return c * (n_old / n_new) + (2.0 / n_new) * jnp.matmul(x.T, x_ref.astype(jnp.float32) - x, precision=_HIGHEST)


class HessianAccumulator:
    """Running ``H = 2/n * sum_t x_t x_t^T`` (float32 [K, K]) over the n input vectors of a linear layer,
    and, when reference inputs come with them, ``C = 2/n * sum_t x_t (x_ref_t - x_t)^T``: the inputs the
    unquantized model gives the same linear for the same tokens (GPTAQ's asymmetric calibration)."""

    def __init__(self, k: int):
        if not isinstance(k, (int, np.integer)) or k <= 0:
            raise MiniCPMError(f"HessianAccumulator needs a positive in_features, got {k!r}")
        self.k = int(k)
        self._h = jnp.zeros((self.k, self.k), jnp.float32)
        self._c = None
        self._n = 0

    def add(self, x, x_ref=None) -> None:
        """Adds the activations ``x [..., K]`` (any float dtype; every leading index is one sample) and,
        optionally, the full-precision model's inputs ``x_ref`` for the same samples (same shape). Either
        every call passes ``x_ref`` or none does."""
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[-1] != self.k:
            raise MiniCPMError(f"activations must have shape [..., {self.k}], got {tuple(x.shape)}")
        if x_ref is not None and tuple(jnp.shape(x_ref)) != tuple(x.shape):
            raise MiniCPMError(f"reference activations must have the shape of x {tuple(x.shape)}, "
                               f"got {tuple(jnp.shape(x_ref))}")
        if self._n and (x_ref is None) != (self._c is None):
            raise MiniCPMError("HessianAccumulator: pass reference activations with every batch or with none")
        x = x.reshape(-1, self.k)
        if x.shape[0] == 0:
            return
        n_new = self._n + x.shape[0]
        n_old_f, n_new_f = jnp.float32(self._n), jnp.float32(n_new)
        if x_ref is not None:
            c = self._c if self._c is not None else jnp.zeros((self.k, self.k), jnp.float32)
            self._c = _cross_update(c, x, jnp.asarray(x_ref).reshape(-1, self.k), n_old_f, n_new_f)
        self._h = _hessian_update(self._h, x, n_old_f, n_new_f)
        self._n = n_new

    @property
    def hessian(self) -> np.ndarray:
        """float32 [K, K] (zeros before the first ``add``)."""
        return np.array(self._h, dtype=np.float32)

    @property
    def cross(self) -> np.ndarray | None:
        """float32 [K, K] ``C``, or None when no reference activations were added."""
        return None if self._c is None else np.array(self._c, dtype=np.float32)

    @property
    def count(self) -> int:
        """The number of input vectors seen so far."""
        return self._n


# --------------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------------


def _upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """The upper-triangular U with ``inv(h) = U^T U`` (float64), for a symmetric positive definite h.

    With J the row-reversal permutation and ``J h J = L L^T``, ``inv(h) = (J L^-1 J)^T (J L^-1 J)``
    and ``J L^-1 J`` is upper triangular with a positive diagonal: one Cholesky, one triangular inverse.
    """
    rev = h[::-1, ::-1]
    try:
        lower = np.linalg.cholesky(rev)
    except np.linalg.LinAlgError:
        lower = None
    if lower is None or not np.all(np.isfinite(lower)):
        raise MiniCPMError(
            "GPTQ: the damped Hessian is not positive definite (Cholesky failed); "
            "use a larger damp_percent (e.g. 0.05 or 0.1) or more calibration data"
        )
    lower_inv = scipy.linalg.solve_triangular(lower, np.eye(len(h)), lower=True)
    return lower_inv[::-1, ::-1]


@partial(jax.jit, static_argnames=("block_size", "group_size", "sym"))
def _gptq_core(w, hinv, row_scale, row_zero, *, block_size: int, group_size: int, sym: bool):
    """GPTQ over the rows of ``w float32 [Kp, N]`` in processing order (Kp a multiple of block_size).

    ``hinv float32 [Kp, Kp]`` is the upper Cholesky factor of the inverse damped Hessian. With
    ``group_size == 0`` row i uses the fixed grid ``(row_scale[i], row_zero[i])`` ([Kp, N] each);
    otherwise group_size divides block_size and a new grid is computed from the current
    (error-updated) rows whenever i is a multiple of it. Returns float32 ``(q, scale, zero)``, each
    [Kp, N], with the grid used for every row.
    """
    kp, n = w.shape

    def block(b, carry):
        w, q, s, z = carry
        i1 = b * block_size
        h_rows = lax.dynamic_slice_in_dim(hinv, i1, block_size)  # [bs, Kp], zero left of the block
        h1 = lax.dynamic_slice_in_dim(h_rows, i1, block_size, axis=1)
        s1 = lax.dynamic_slice_in_dim(s, i1, block_size)
        z1 = lax.dynamic_slice_in_dim(z, i1, block_size)

        def column(i, carry):
            w1, q1, err1, s1, z1, scale, zero = carry
            if group_size:
                scale, zero = lax.cond(
                    i % group_size == 0,
                    lambda: int4.group_grid(lax.dynamic_slice_in_dim(w1, i, group_size), sym, jnp),
                    lambda: (scale, zero),
                )
                s1, z1 = s1.at[i].set(scale), z1.at[i].set(zero)
            else:
                scale, zero = s1[i], z1[i]
            row = w1[i]
            q = _quantize(row, scale, zero)
            err = (row - scale * (q - zero)) / h1[i, i]
            # h1 is upper triangular: earlier rows are left alone, later ones take the error feedback.
            w1 = w1 - h1[i][:, None] * err[None, :]
            return w1, q1.at[i].set(q), err1.at[i].set(err), s1, z1, scale, zero

        rows = lax.dynamic_slice_in_dim(w, i1, block_size)
        init = (rows, jnp.zeros_like(rows), jnp.zeros_like(rows), s1, z1,
                jnp.ones((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
        _, q1, err1, s1, z1, _, _ = lax.fori_loop(0, block_size, column, init)
        # Lazy batch update: the block's error reaches every later row at once (the block's own rows
        # change too, but they are already quantized; earlier rows see zeros of h_rows).
        w = w - jnp.matmul(h_rows.T, err1, precision=_HIGHEST)
        q = lax.dynamic_update_slice_in_dim(q, q1, i1, 0)
        s = lax.dynamic_update_slice_in_dim(s, s1, i1, 0)
        z = lax.dynamic_update_slice_in_dim(z, z1, i1, 0)
        return w, q, s, z

    _, q, s, z = lax.fori_loop(0, kp // block_size, block, (w, jnp.zeros_like(w), row_scale, row_zero))
    return q, s, z


def gptq_quantize(
    w,
    hessian,
    *,
    group_size: int,
    sym: bool = True,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float = 0.01,
    block_size: int = 128,
    cross=None,
) -> QuantizedWeight:
    """GPTQ 4-bit quantization of ``w float32 [K, N]`` given the input Hessian ``float [K, K]``.

    ``cross`` (``float [K, K]``, :attr:`HessianAccumulator.cross`): asymmetric calibration (GPTAQ, Li et
    al. 2025). GPTQ fits ``X w_hat`` to ``X w`` on the inputs X the partly quantized model gives this
    layer; with ``C = 2/n X^T (X_ref - X)`` it fits ``X_ref w``, the full-precision model's output, instead.
    The least-squares target ``w + H_d^-1 C w`` (``H_d`` the damped Hessian) is then quantized as usual,
    since ``|X_ref w - X w_hat|^2`` differs from ``|X (w + H^-1 C w) - X w_hat|^2`` by a constant.

    Rows (inputs) with ``H[i, i] == 0`` are dead: their weights become 0. With ``desc_act`` rows are
    processed in order of decreasing ``diag(H)``. ``damp_percent * mean(diag(H))`` is added to the
    diagonal. A group's grid is computed from the current (error-updated) rows when processing
    reaches its first row, or, with ``static_groups``, up front from the original rows k // G (for
    G = -1 the single grid is always computed up front). ``g_idx[k] = k // G``, except with
    ``desc_act`` and not ``static_groups``, where it is ``(position of k in processing order) // G``.
    ``q`` is in the original row order. ``block_size`` (rows per lazy batch) does not change the
    result beyond float32 rounding; with per-group grids it is rounded up to a multiple of G.
    Raises MiniCPMError for bad arguments or a damped Hessian that is not positive definite.
    """
    w = _as_weight(w)
    k, n = w.shape
    g = _effective_group_size(group_size, k)
    h = np.array(hessian, dtype=np.float64)
    if h.shape != (k, k):
        raise MiniCPMError(f"GPTQ: the Hessian must have shape ({k}, {k}) for a weight [{k}, {n}], got {h.shape}")
    if not np.all(np.isfinite(h)):
        raise MiniCPMError("GPTQ: the Hessian contains NaN or infinite values")
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size <= 0:
        raise MiniCPMError(f"GPTQ: block_size must be a positive integer, got {block_size!r}")
    if not np.isfinite(damp_percent) or damp_percent < 0:
        raise MiniCPMError(f"GPTQ: damp_percent must be a finite number >= 0, got {damp_percent!r}")

    w = w.copy()
    dead = np.flatnonzero(np.diag(h) == 0)
    h[dead, dead] = 1.0
    w[dead] = 0.0
    diag = np.diag(h)
    if cross is not None:
        c = np.array(cross, dtype=np.float64)
        if c.shape != (k, k) or not np.all(np.isfinite(c)):
            raise MiniCPMError(f"GPTQ: cross must be a finite [{k}, {k}] matrix, got shape {c.shape}")
        c[dead] = 0.0
        h_damped = h + damp_percent * np.mean(diag) * np.eye(k)
        try:
            w = (w + scipy.linalg.solve(h_damped, c @ w, assume_a="pos")).astype(np.float32)
        except (np.linalg.LinAlgError, ValueError):
            raise MiniCPMError("GPTQ: the damped Hessian is not positive definite (asymmetric calibration); "
                               "use a larger damp_percent") from None
        w[dead] = 0.0

    perm = np.argsort(-diag, kind="stable") if desc_act else np.arange(k)
    invperm = np.argsort(perm)
    h = h[np.ix_(perm, perm)]
    h[np.diag_indices(k)] += damp_percent * np.mean(diag)
    hinv = _upper_cholesky_of_inverse(h)

    dynamic = g < k and not static_groups
    if dynamic:
        bs = min(max(block_size // g, 1) * g, k)  # groups never straddle blocks
        row_group = np.arange(k) // g  # by position in processing order
    else:
        bs = min(block_size, k)
        scale, zero = _group_params_np(w, g, sym)  # exactly rtn_quantize's grids
        row_group = perm // g  # the original group of the row at each position
    kp = -(-k // bs) * bs

    # Pad to whole blocks with independent dummy rows (zero weight, identity Hessian) at the end.
    w_p = np.zeros((kp, n), np.float32)
    w_p[:k] = w[perm]
    hinv_p = np.eye(kp, dtype=np.float32)
    hinv_p[:k, :k] = hinv
    row_scale = np.ones((kp, n), np.float32)
    row_zero = np.zeros((kp, n), np.float32)
    if not dynamic:
        row_scale[:k], row_zero[:k] = scale[row_group], zero[row_group]

    q, row_scale, row_zero = (np.asarray(a) for a in _gptq_core(
        jnp.asarray(w_p), jnp.asarray(hinv_p), jnp.asarray(row_scale), jnp.asarray(row_zero),
        block_size=bs, group_size=g if dynamic else 0, sym=sym,
    ))
    if dynamic:
        scale, zero = row_scale[:k:g], row_zero[:k:g]  # the grid of each group's first row
        g_idx = row_group[invperm]
    else:
        g_idx = np.arange(k) // g
    return QuantizedWeight(
        q=q[:k][invperm].astype(np.uint8),
        scale=np.asarray(scale, dtype=np.float32),
        zero=np.asarray(zero).astype(np.uint8),
        g_idx=g_idx.astype(np.int32),
    )
