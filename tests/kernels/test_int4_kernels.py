"""The W4A16 Pallas kernels (pallas_kernels/int4_matmul.py, int4_planes.py) against ``x @ W`` in float64 NumPy, W
dequantized from the format definition (``tests/oracles.py``); the int4 formats themselves:
``tests/io/test_int4_formats.py``.

The CPU tests run the kernel in Pallas interpret mode; ``test_gpu_*`` runs it compiled at MiniCPM4-8B
shapes (``pytest -m gpu`` on a GPU machine, skipped elsewhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minicpm_jax.io import int4_formats as int4
from pallas_kernels import int4_codes
from pallas_kernels import int4_matmul as kern
from tests import helpers
from tests.helpers import assert_close, random_gptq_tensors, random_weight
from tests.oracles import gptq_dequant_oracle


# -------------------------------------------------------------------------------------- CPU (interpret mode)
def _oracle_y(x, w: int4.Int4Weight):
    return np.asarray(x, np.float64) @ w.dequantize().astype(np.float64)


# (k, n, group_size, sym, act_order, m, splits, config)
_KERNEL_CASES = [
    pytest.param(256, 128, 32, True, False, 1, None, None, id="sym-g32-m1"),
    pytest.param(256, 192, 64, False, False, 3, None, None, id="asym-g64-m3-n192"),
    pytest.param(256, 128, 256, False, False, 20, None, None, id="asym-perchannel-m20"),
    pytest.param(256, 64, 256, True, False, 1, None, None, id="sym-perchannel-m1"),
    pytest.param(512, 128, 128, True, True, 3, None, None, id="sym-g128-actorder-m3"),
    pytest.param(512, 128, 64, False, True, 1, None, None, id="asym-g64-actorder-m1"),
    pytest.param(512, 128, 128, False, True, 20, None, None, id="asym-g128-actorder-m20"),
    pytest.param(256, 128, 64, True, False, 1, 2, None, id="splits2-m1"),
    pytest.param(256, 128, 32, False, False, 20, 2, None, id="splits2-m20"),
    pytest.param(512, 128, 64, False, False, 3, None, kern.Int4Config(16, 64, 256, 4, 3), id="blockk256-g64-m3"),
    pytest.param(512, 128, 64, True, True, 1, 2, kern.Int4Config(1, 128, 256, 4, 2), id="blockk256-g64-splits2-m1"),
]


@pytest.mark.parametrize("k,n,gs,sym,act_order,m,splits,config", _KERNEL_CASES)
def test_int4_matmul_matches_numpy(k, n, gs, sym, act_order, m, splits, config):
    rng = np.random.default_rng(k + n + gs + m + 7 * sym + 11 * act_order)
    w = random_weight(rng, k, n, gs, sym=sym, act_order=act_order)
    e = int4.to_engine(w)
    assert ("perm" in e) == act_order and ("zeros" in e) == (not sym)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = _oracle_y(x, w)
    arrays = {name: jnp.asarray(a) for name, a in e.items()}

    ref = kern.int4_matmul_reference(jnp.asarray(x), **arrays, group_size=gs)
    assert ref.dtype == jnp.float32 and ref.shape == (m, n)
    assert_close(ref, want, 1e-5)

    if config is not None:  # the override really is used as given (block_k spans several groups)
        cfg, _ = kern.choose_config(m, k, n, gs, config)
        assert cfg.block_k == config.block_k > gs
    y = kern.int4_matmul(jnp.asarray(x), **arrays, group_size=gs, config=config, splits=splits)
    assert y.dtype == jnp.float32 and y.shape == (m, n)
    assert_close(y, want, 1e-5)
    if splits:  # a row-parallel linear's product: the kernel's K-split parts left unreduced
        parts = kern.int4_matmul_parts(jnp.asarray(x), **arrays, group_size=gs, config=config, splits=splits)
        assert parts.parts.shape[0] == splits and parts.shape == (m, n)
        assert_close(parts.total(), want, 1e-5)
        assert kern.int4_matmul_parts_reference(jnp.asarray(x), **arrays, group_size=gs).parts.shape == (1, m, n)

    # dequantize: rows in stored (group-sorted) order, columns natural
    stored = int4.sort_by_group(w)[0]
    deq = kern.dequantize(arrays["qweight"], arrays["scales"], arrays.get("zeros"), group_size=gs)
    np.testing.assert_allclose(np.asarray(deq), stored.dequantize(), rtol=1e-6, atol=0)


def test_a_one_row_products_parts_are_cut_to_what_the_consumer_adds():
    """The one-row kernel splits a long K into more parts than the fused all-reduce adds (64 here: one part a
    128-row step, K = 8192 as MiniCPM4-8B's down_proj at TP 2, a narrow N); ``max_parts`` leaves at most that many
    (a divisor of the kernel's split), without it the kernel's own, each with the same product."""
    from pallas_kernels.peer_all_reduce import MAX_PARTS

    k, n, gs = 8192, 64, 128
    rng = np.random.default_rng(5)
    w = random_weight(rng, k, n, gs, sym=True, act_order=False)
    arrays = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    x = rng.standard_normal((1, k)).astype(np.float32)
    assert kern.choose_config(1, k, n, gs, kernel=kern.default_kernel(1, gs))[1] == 64
    assert kern.int4_matmul_parts(jnp.asarray(x), **arrays, group_size=gs).parts.shape == (64, 1, n)
    parts = kern.int4_matmul_parts(jnp.asarray(x), **arrays, group_size=gs, max_parts=MAX_PARTS)
    assert parts.parts.shape == (MAX_PARTS, 1, n)
    assert kern.int4_matmul_parts(jnp.asarray(x), **arrays, group_size=gs, max_parts=12).parts.shape[0] == 8
    assert_close(parts.total(), _oracle_y(x, w), 1e-5)


def test_one_row_launch_takes_128_columns_where_a_wave_of_programs_stays(monkeypatch):
    """The default one-row launch takes 128-column tiles where they keep at least 7 programs per core in at most 32
    K-split parts, else the entry's 64 columns: on 132 cores MiniCPM4-8B's q/k/v, o_proj and gate_up go wide, its
    down_proj (64 parts) does not, nor at TP 2 any linear but gate_up (under a wave). A given config or split count
    is taken as given."""
    monkeypatch.setattr(kern, "num_cores", lambda: 132)
    want = {(4096, 4608): (128, 32), (4096, 4096): (128, 32), (4096, 32768): (128, 8), (16384, 4096): (64, 32),
            (4096, 2304): (64, 32), (2048, 4096): (64, 16), (4096, 16384): (128, 16), (8192, 4096): (64, 32)}
    for (k, n), (block_n, splits) in want.items():
        cfg, got = kern.choose_config(1, k, n, 128, kernel="planes")
        assert (cfg.block_n, cfg.block_k, got) == (block_n, 128, splits), (k, n)
    assert kern.choose_config(1, 4096, 4096, 128, kernel="planes", splits=4) == (
        kern.Int4Config(1, 64, 128, 4, 2), 4)
    given = kern.Int4Config(1, 64, 128, 4, 2)
    assert kern.choose_config(1, 4096, 4096, 128, given, kernel="planes")[0] == given
    assert kern.choose_config(2, 4096, 4096, 128, kernel="planes")[0].block_n == 64  # the 16-row entry's own


def test_two_to_sixteen_row_launch_runs_one_warp_a_program_at_eight_per_core(monkeypatch):
    """2..16 rows (decode batches, speculative trees) run `planes` in one-warp programs of 64 columns, K split until
    there are about 8 programs per core: on 132 cores MiniCPM4-8B's four linears keep the K-split parts the 4-warp,
    128-column launch at 4 per core had (so their consumers add as many); 17..64 rows take `planes_t` at 2 warps."""
    monkeypatch.setattr(kern, "num_cores", lambda: 132)
    want = {(4096, 4608): 8, (4096, 4096): 16, (4096, 32768): 2, (16384, 4096): 16}
    for m in (2, 12, 16):
        for (k, n), splits in want.items():
            cfg, got = kern.choose_config(m, k, n, 128, kernel=kern.default_kernel(m, 128))
            assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, got) == (16, 64, 1, 3, splits), (m, k, n)
    cfg, got = kern.choose_config(64, 4096, 32768, 128, kernel=kern.default_kernel(64, 128))
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, got) == (64, 64, 2, 1)


@pytest.mark.parametrize("gs,sym,act_order,n", [(32, False, True, 128), (512, True, False, 128), (64, True, False, 128),
                                                (48, False, False, 100)],
                         ids=["asym-g32-actorder", "sym-perchannel", "sym-g64", "g48-n100-no-pow2-tile"])
def test_prefill_chunks_match_the_oracle(gs, sym, act_order, n):
    """More than MAX_KERNEL_ROWS rows run int4_matmul_prefill: the float64 oracle's product (act-order
    permutes x first), also when the first element of x — which the dequantization reads — is not finite,
    and for shapes the dequantization kernel cannot tile in powers of 2 (which it refuses; XLA's fusion
    dequantizes those)."""
    rng = np.random.default_rng(gs + sym)
    k, m = 384 if gs == 48 else 512, kern.MAX_KERNEL_ROWS + 3
    w = random_weight(rng, k, n, gs, sym=sym, act_order=act_order)
    arrays = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    want = _oracle_y(x[0], w)
    y = kern.int4_matmul_prefill(jnp.asarray(x), **arrays, group_size=gs)
    assert y.shape == (1, m, n) and y.dtype == jnp.float32
    assert_close(y[0], want, 1e-5)
    assert_close(kern.int4_matmul(jnp.asarray(x), **arrays, group_size=gs)[0], want, 1e-5)  # the dispatch
    x[0, 0, 0] = np.inf  # the element the dequantization reads: the other rows must stay exact
    y = kern.int4_matmul_prefill(jnp.asarray(x), **arrays, group_size=gs)
    assert_close(y[0, 1:], want[1:], 1e-5)
    if gs == 48:
        with pytest.raises(ValueError, match="power-of-2"):
            kern.dequantize_kernel(arrays["qweight"], arrays["scales"], arrays.get("zeros"), group_size=gs)


@pytest.mark.parametrize("gs,sym,dtype,tile", [
    (128, True, jnp.bfloat16, None), (32, False, jnp.float32, None), (256, False, jnp.bfloat16, (128, 64, 4)),
    (64, True, jnp.float16, (32, 512, 4))], ids=["sym-g128-bf16", "asym-g32-f32", "asym-g256-tile128", "sym-g64-f16"])
def test_dequantize_kernel_equals_the_reference(gs, sym, dtype, tile):
    """The prefill's dequantization pass, bit for bit :func:`dequantize` (which the oracle checks above):
    natural row order across words and tiles, a tile shorter or longer than a scale group, zero points."""
    rng = np.random.default_rng(gs + sym)
    k, n = 512, 192
    e = {name: jnp.asarray(a, dtype) if name in ("scales", "zeros") else jnp.asarray(a)
         for name, a in int4.to_engine(random_weight(rng, k, n, gs, sym=sym)).items()}
    args = (e["qweight"], e["scales"], e.get("zeros"))
    want = kern.dequantize(*args, group_size=gs, dtype=dtype)
    got = kern.dequantize_kernel(*args, group_size=gs, dtype=dtype, tile=tile)
    assert got.dtype == dtype and got.shape == (k, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_prefill_holds_one_dequantized_weight_at_a_time():
    """A chain of int4 prefill linears (XLA's buffer assignment, compiled without running): with the whole
    weight dequantized from the parameters alone (the reference), the CPU compiler keeps every layer's
    dequantized copy live at once (program memory grows by a weight per layer, as a MiniCPM4-8B prefill
    chunk on an H200 once did: 13.4 GB); with the scales made to wait for x (``scales_after_input``, what
    int4_matmul_prefill does) it grows by the activations only. On a GPU the compiled int4_matmul_prefill
    itself is checked (that compiler does not hoist in a chain this small, so there only that half runs;
    on the CPU its interpret-mode kernel is a loop whose buffers XLA does not share between layers, with or
    without the dependency, which says nothing of the GPU program)."""
    import jax

    k, n, m = 4096, 4096, kern.MAX_KERNEL_ROWS + 4
    weight_bytes = k * n * 2

    def temp_bytes(fn, layers):
        def f(x, qs, ss):
            for q, s_ in zip(qs, ss):
                x = x + fn(x, q, s_, group_size=128)[:, :k] * 0.01
            return x
        args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                [jax.ShapeDtypeStruct((k // 8, n), jnp.int32)] * layers,
                [jax.ShapeDtypeStruct((k // 128, n), jnp.float16)] * layers)
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    def after_input(x, q, s, *, group_size):
        return kern.int4_matmul_reference(x, q, kern.scales_after_input(x, s), group_size=group_size)

    if jax.default_backend() == "cpu":
        whole = temp_bytes(kern.int4_matmul_reference, 6) - temp_bytes(kern.int4_matmul_reference, 1)
        assert whole > 3 * weight_bytes  # the failure this guards against is real on this compiler
        chained = temp_bytes(after_input, 6) - temp_bytes(after_input, 1)
    else:
        chained = temp_bytes(kern.int4_matmul_prefill, 6) - temp_bytes(kern.int4_matmul_prefill, 1)
    assert chained < weight_bytes


def test_int4_matmul_leading_dims_and_gptq_checkpoint():
    """From GPTQ v1 tensors with act-order all the way to the kernel; x with two leading dims."""
    rng = np.random.default_rng(15)
    k, n, gs = 256, 128, 64
    _, qweight, qzeros, scales, g_idx = random_gptq_tensors(rng, k, n, gs, sym=False, fmt="gptq", act_order=True)
    w = int4.gptq_unpack(qweight, qzeros, scales, g_idx, group_size=gs, sym=False)
    e = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    dense = gptq_dequant_oracle(qweight, qzeros, scales, g_idx, "gptq")
    want = (x.reshape(6, k).astype(np.float64) @ dense).reshape(2, 3, n)
    y = kern.int4_matmul(jnp.asarray(x), **e, group_size=gs)
    assert y.shape == (2, 3, n)
    assert_close(y, want, 1e-5)


@pytest.mark.parametrize("m", [1, 20])
def test_int4_matmul_bf16(m):
    """bf16 activations, scales and zeros (the model dtype) against the fp32 result."""
    rng = np.random.default_rng(16 + m)
    k, n, gs = 256, 128, 64
    w = random_weight(rng, k, n, gs, sym=False, act_order=True)
    e = int4.to_engine(w)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = _oracle_y(x, w)
    bf = {name: jnp.asarray(a, jnp.bfloat16) if name in ("scales", "zeros") else jnp.asarray(a)
          for name, a in e.items()}
    xb = jnp.asarray(x, jnp.bfloat16)
    y = kern.int4_matmul(xb, **bf, group_size=gs)
    ref = kern.int4_matmul_reference(xb, **bf, group_size=gs)
    assert y.dtype == jnp.bfloat16 and ref.dtype == jnp.bfloat16
    assert_close(np.asarray(y, np.float32), want, 3e-2)
    assert_close(np.asarray(ref, np.float32), want, 3e-2)
    assert helpers.rel_err(np.asarray(y, np.float32), want) < 1e-2


# (k, n, group_size, sym, act_order, m, kernel, config)
_PLANE_CASES = [
    pytest.param(256, 128, 32, True, False, 1, "planes", None, id="gemv-g32"),
    pytest.param(512, 256, 128, False, True, 1, "planes", kern.Int4Config(1, 64, 256, 4, 2), id="gemv-asym-actorder-k256"),
    pytest.param(256, 128, 256, False, False, 1, "planes", None, id="gemv-asym-perchannel"),
    pytest.param(512, 128, 128, True, False, 5, "planes", None, id="dot-m5"),
    pytest.param(512, 256, 128, False, True, 16, "planes", kern.Int4Config(16, 64, 256, 4, 2), id="dot-asym-actorder-k256"),
    pytest.param(256, 128, 256, False, False, 20, "planes", None, id="dot-asym-perchannel-m20"),
    pytest.param(512, 128, 128, True, True, 40, "planes_t", None, id="dot_t-actorder-m40"),
    pytest.param(512, 256, 128, False, False, 33, "planes_t", kern.Int4Config(32, 128, 256, 4, 2), id="dot_t-asym-bm32"),
]


@pytest.mark.parametrize("k,n,gs,sym,act_order,m,kernel,config", _PLANE_CASES)
def test_int4_plane_kernels_match_numpy(k, n, gs, sym, act_order, m, kernel, config):
    """The nibble-plane kernels (one-row GEMV, tensor-core dot and its transposed form) against a NumPy
    dequantization, with zero points, act-order, sub-blocks shorter than the group, rows padded to the tile."""
    rng = np.random.default_rng(k + n + gs + m + 3 * sym + 5 * act_order)
    w = random_weight(rng, k, n, gs, sym=sym, act_order=act_order)
    arrays = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = kern.int4_matmul(jnp.asarray(x), **arrays, group_size=gs, kernel=kernel, config=config,
                         splits=2 if m == 1 else None)
    assert y.dtype == jnp.float32 and y.shape == (m, n)
    assert_close(y, _oracle_y(x, w), 1e-5)


def test_plane_pairs_hold_every_code_exactly():
    """Nibbles p and p + 4 of a word become ``offset + code`` in the two halves' 16-bit floats (bf16, fp16, and
    the bf16 pair widened to float32), every code in every position, words with the sign bit set among them:
    against NumPy's reading of the nibbles."""
    nibbles = (np.arange(16)[:, None] + np.arange(8)[None, :]) % 16  # word i, nibble j: code (i + j) mod 16
    words = (nibbles.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))).sum(1, dtype=np.uint32)
    words = jnp.asarray(words.view(np.int32).reshape(4, 4))
    assert int(jnp.sum(words < 0)) == 8
    for dtype, (magic, offset) in [(jnp.bfloat16, int4_codes.PAIR_CODES[jnp.dtype(jnp.bfloat16)]),
                                   (jnp.float16, int4_codes.PAIR_CODES[jnp.dtype(jnp.float16)]),
                                   (jnp.float32, int4_codes.PAIR_CODES[jnp.dtype(jnp.bfloat16)])]:
        for p in range(4):
            lo, hi = int4_codes.plane_pair(words, p, magic, dtype)
            assert lo.dtype == hi.dtype == dtype
            np.testing.assert_array_equal(np.asarray(lo, np.float64).reshape(16), offset + nibbles[:, p])
            np.testing.assert_array_equal(np.asarray(hi, np.float64).reshape(16), offset + nibbles[:, p + 4])
            if dtype != jnp.float32:  # the 2..16-row kernel's centred pairs: q − 8
                lo, hi = int4_codes.centred_pair(words, p, dtype)
                assert lo.dtype == hi.dtype == dtype
                np.testing.assert_array_equal(np.asarray(lo, np.float64).reshape(16), nibbles[:, p] - 8)
                np.testing.assert_array_equal(np.asarray(hi, np.float64).reshape(16), nibbles[:, p + 4] - 8)
        if dtype == jnp.float32:  # the one-row kernel's unmasked high half carries the low half at 2^-16
            for p in range(4):
                _, hi = int4_codes.plane_pair(words, p, magic, dtype, raw_high=True)
                want = offset + nibbles[:, p + 4] + (magic + nibbles[:, p]) / 65536
                np.testing.assert_array_equal(np.asarray(hi, np.float64).reshape(16), want)


# (k, n, group_size, sym, act_order, m, kernel, x dtype)
_PAIR_CASES = [
    pytest.param(512, 128, 128, True, False, 12, "planes_t", jnp.bfloat16, id="dot_t-bf16-m12"),
    pytest.param(512, 128, 128, True, False, 12, "planes", jnp.bfloat16, id="dot-bf16-m12"),
    pytest.param(512, 256, 128, False, True, 7, "planes", jnp.bfloat16, id="dot-bf16-asym-actorder-m7"),
    pytest.param(512, 256, 128, False, True, 5, "planes", jnp.float16, id="dot-f16-asym-actorder"),
    pytest.param(256, 128, 64, False, False, 1, "planes", jnp.float16, id="gemv-f16-asym"),
    pytest.param(512, 128, 128, True, False, 1, "planes", jnp.bfloat16, id="gemv-bf16-sym"),
]


@pytest.mark.parametrize("k,n,gs,sym,act_order,m,kernel,dtype", _PAIR_CASES)
def test_int4_plane_kernels_with_16_bit_x_take_code_pairs(k, n, gs, sym, act_order, m, kernel, dtype):
    """16-bit x runs the plane kernels on code pairs (``offset + q``, the offset removed through the chunk sums
    of x, which the one-row kernel adds from its planes itself; ``planes``: centred, ``q − 8``, the chunk sums
    only with zero points): the float32 reference on the same 16-bit
    inputs, to float32 accumulation plus, at one row, the unmasked high halves' residual (``PAIR_LOW_HALF``,
    ~1e-5 here; without its correction 8e-3 and more). The bf16 test above allows a bf16 result's rounding,
    which would hide a code off by one."""
    rng = np.random.default_rng(k + m + gs)
    w = random_weight(rng, k, n, gs, sym=sym, act_order=act_order)
    arrays = {name: jnp.asarray(a, dtype) if name in ("scales", "zeros") else jnp.asarray(a)
              for name, a in int4.to_engine(w).items()}
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = kern.int4_matmul(x, **arrays, group_size=gs, kernel=kernel, out_dtype=jnp.float32)
    exact = kern.int4_matmul_reference(x.astype(jnp.float32), **{
        name: a.astype(jnp.float32) if name in ("scales", "zeros") else a for name, a in arrays.items()},
        group_size=gs)
    assert y.dtype == jnp.float32 and y.shape == (m, n)
    assert_close(y, exact, 2e-5)


@pytest.mark.parametrize("interpret", [True, False, None])
def test_plane_kernels_take_inline_ptx_only_when_compiled(monkeypatch, interpret):
    """The plane kernels get ``asm`` (single PTX instructions, pallas_kernels/inline_ptx.py) exactly when they are
    compiled, not interpreted (None: interpreted off the GPU), for one row and for the dot rows."""
    asm = jax.default_backend() == "gpu" if interpret is None else not interpret
    seen = []

    def fake_pallas_call(body, *, out_shape, **_):
        seen.append(body.keywords["asm"])
        return lambda *args: jnp.zeros(out_shape.shape, out_shape.dtype)

    monkeypatch.setattr(kern.pl, "pallas_call", fake_pallas_call)
    w = random_weight(np.random.default_rng(4), 256, 64, 128)
    e = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    for m in (1, 12):
        kern.int4_matmul(jnp.zeros((m, 256), jnp.bfloat16), **e, group_size=128, interpret=interpret)
    assert seen == [asm, asm]


def test_one_row_kernel_takes_x_as_it_is(monkeypatch):
    """One row hands the kernel x itself (bf16, flat), so nothing launches before it to cut x into planes (the
    kernel splits them out, and equals numpy in the tests above); more rows get x's pair planes."""
    seen = []

    def fake_pallas_call(body, *, out_shape, **_):
        def call(*args):
            seen.append(args[0])
            return jnp.zeros(out_shape.shape, out_shape.dtype)
        return call

    monkeypatch.setattr(kern.pl, "pallas_call", fake_pallas_call)
    w = random_weight(np.random.default_rng(8), 256, 64, 128)
    e = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 256)), jnp.bfloat16)
    kern.int4_matmul_parts(x, **e, group_size=128)
    kern.int4_matmul_parts(jnp.concatenate([x, x]), **e, group_size=128)
    assert seen[0].dtype == jnp.bfloat16 and seen[0].shape == (256,)
    np.testing.assert_array_equal(np.asarray(seen[0], np.float32), np.asarray(x[0], np.float32))
    assert seen[1].shape == (4, 16, 64)  # two rows padded to a 16-row tile: 4 pair planes of K/4


def test_int4_default_kernel_choice():
    """One row, and 2..64 rows with scale groups of >= 128, take the plane kernels; the rest the tile
    kernel."""
    assert kern.default_kernel(1, 128) == kern.default_kernel(1, 32) == "planes"
    assert kern.default_kernel(2, 128) == kern.default_kernel(16, 4096) == "planes"
    assert kern.default_kernel(17, 128) == kern.default_kernel(64, 128) == "planes_t"
    assert kern.default_kernel(65, 128) == "tile"
    assert kern.default_kernel(16, 64) == "tile"
    rng = np.random.default_rng(19)
    e = {name: jnp.asarray(a) for name, a in int4.to_engine(random_weight(rng, 256, 64, 64)).items()}
    with pytest.raises(ValueError, match="128 input rows"):
        kern.int4_matmul(jnp.zeros((16, 256)), **e, group_size=64, kernel="planes")
    e = {name: jnp.asarray(a) for name, a in int4.to_engine(random_weight(rng, 256, 64, 128)).items()}
    with pytest.raises(ValueError, match="unknown int4 kernel"):
        kern.int4_matmul(jnp.zeros((16, 256)), **e, group_size=128, kernel="gemlite")


@pytest.mark.parametrize("k,gs", [(96, 12)])
def test_int4_matmul_rejects_group_sizes_it_cannot_tile(k, gs):
    rng = np.random.default_rng(18)
    w = random_weight(rng, k, 64, gs, sym=True)
    e = {name: jnp.asarray(a) for name, a in int4.to_engine(w).items()}
    x = rng.standard_normal((1, k)).astype(np.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        kern.int4_matmul(jnp.asarray(x), **e, group_size=gs)
    # the reference has no tiling constraint
    assert_close(kern.int4_matmul_reference(jnp.asarray(x), **e, group_size=gs), _oracle_y(x, w), 1e-5)


def test_int4_matmul_rejects_mismatched_inputs():
    rng = np.random.default_rng(17)
    e = int4.to_engine(random_weight(rng, 128, 64, 32))
    with pytest.raises(ValueError, match="features"):
        kern.int4_matmul(jnp.zeros((1, 64)), e["qweight"], e["scales"], group_size=32)
    with pytest.raises(ValueError, match="scales"):
        kern.int4_matmul(jnp.zeros((1, 128)), e["qweight"], e["scales"], group_size=64)


# ----------------------------------------------------------------------------------- 6. GPU
_GPU_CASES = [  # (m, sym, act_order); 2..64 rows run the plane kernels, > MAX_KERNEL_ROWS the prefill pass
    (1, True, False),
    (16, True, False),
    (64, False, False),
    (1, False, True),
    (5, False, True),
    (32, True, True),
    (100, True, False),
    (kern.MAX_KERNEL_ROWS + 44, False, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,sym,act_order", _GPU_CASES)
def test_gpu_int4_matmul_minicpm4_8b_shapes(m, sym, act_order):
    """Compiled kernel (bf16) at the MiniCPM4-8B qkv shape (K=4096, N=4096+2·256, g128)."""
    rng = np.random.default_rng(m + 3 * sym + 5 * act_order)
    k, n, gs = 4096, 4608, 128
    w = random_weight(rng, k, n, gs, sym=sym, act_order=act_order)
    e = int4.to_engine(w)
    arrays = {name: jnp.asarray(a, jnp.bfloat16) if name in ("scales", "zeros") else jnp.asarray(a)
              for name, a in e.items()}
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), jnp.bfloat16)
    y = kern.int4_matmul(x, **arrays, group_size=gs, interpret=False)
    ref = kern.int4_matmul_reference(x, **arrays, group_size=gs)
    exact = kern.int4_matmul_reference(x.astype(jnp.float32), **arrays, group_size=gs)
    y, ref, exact = (np.asarray(a, np.float32) for a in (y, ref, exact))
    assert y.shape == (m, n) and np.all(np.isfinite(y))
    # the fp32 reference against a host oracle: x and the scales rounded to bf16 like the device inputs
    scales_bf16 = np.asarray(jnp.asarray(w.scales, jnp.bfloat16), np.float32)
    host = int4.Int4Weight(w.q, scales_bf16, w.zeros, w.g_idx, gs)
    assert_close(exact, np.asarray(x, np.float64) @ host.dequantize().astype(np.float64), 1e-4)
    assert_close(y, exact, 1e-2)
    assert_close(ref, exact, 1e-2)
    assert helpers.rel_err(y, exact) < 5e-3


@pytest.mark.gpu
def test_gpu_int4_parts_of_a_long_k_row():
    """Compiled kernel (bf16), one row at MiniCPM4-8B's down_proj split over 2 GPUs (K=8192, N=4096, g128): the
    fused all-reduce's MAX_PARTS parts sum to the product."""
    from pallas_kernels.peer_all_reduce import MAX_PARTS

    rng = np.random.default_rng(11)
    k, n, gs = 8192, 4096, 128
    w = random_weight(rng, k, n, gs, sym=True, act_order=False)
    arrays = {name: jnp.asarray(a, jnp.bfloat16) if name == "scales" else jnp.asarray(a)
              for name, a in int4.to_engine(w).items()}
    x = jnp.asarray(rng.standard_normal((1, k)).astype(np.float32), jnp.bfloat16)
    parts = kern.int4_matmul_parts(x, **arrays, group_size=gs, max_parts=MAX_PARTS, interpret=False)
    exact = kern.int4_matmul_reference(x.astype(jnp.float32), **arrays, group_size=gs)
    assert parts.parts.shape == (MAX_PARTS, 1, n)
    assert helpers.rel_err(np.asarray(parts.total()), np.asarray(exact)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4608), (4096, 4096), (4096, 32768), (16384, 4096)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_gpu_one_row_at_each_minicpm4_8b_linear(k, n):
    """Compiled one-row kernel (bf16 x, g128, symmetric) with its default launch at each MiniCPM4-8B linear of one
    GPU: the split the launch picks for the shape, its parts summed, equals the float32 reference."""
    rng = np.random.default_rng(k + n)
    w = random_weight(rng, k, n, 128, sym=True, act_order=False)
    arrays = {name: jnp.asarray(a, jnp.bfloat16) if name == "scales" else jnp.asarray(a)
              for name, a in int4.to_engine(w).items()}
    x = jnp.asarray(rng.standard_normal((1, k)).astype(np.float32), jnp.bfloat16)
    parts = kern.int4_matmul_parts(x, **arrays, group_size=128, interpret=False)
    exact = kern.int4_matmul_reference(x.astype(jnp.float32), **arrays, group_size=128)
    assert parts.parts.shape[0] == kern.choose_config(1, k, n, 128, kernel="planes")[1] > 1
    assert helpers.rel_err(np.asarray(parts.total()), np.asarray(exact)) < 5e-3
