"""InfLLM-v2 sparse attention: stage-1 scores and block selection against a NumPy re-derivation of the
published formulas, the Pallas kernels against their jnp references (interpret mode), incremental
compressed caches, sparse-vs-dense equivalences, prefill/decode agreement, generation, a planted-block
retrieval test of the selector, and settings errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.engine import Engine
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model import MiniCPMForCausalLM
from minicpm_jax.sampling import SamplingParams
from minicpm_jax.sparse import attention_mode, resolve_sparse, select_blocks
from pallas_kernels.sparse_attention import (
    block_sparse_attention,
    block_sparse_attention_reference,
    compressed_scores,
    compressed_scores_reference,
)
from tests import helpers

# MiniCPM4's geometry scaled down 8x: windows 4/2 and 16/8, 8-token blocks, 2 local blocks + 1 init.
SMALL = SparseConfig(kernel_size=4, kernel_stride=2, init_blocks=1, block_size=8, window_size=16, topk=3,
                     use_nope=False, dense_len=32)
MAX_LEN = 128


def _config(sparse: SparseConfig | None = SMALL) -> ModelConfig:
    raw = helpers.tiny_minicpm_config(sparse_config=None if sparse is None else dataclasses.asdict(sparse))
    if sparse is None:
        del raw["sparse_config"]
    return ModelConfig.from_dict(raw)


def _model(sparse="auto", impl="xla", config=None, max_length=MAX_LEN):
    return MiniCPMForCausalLM(config or _config(), max_length=max_length, attention_impl=impl, rngs=nnx.Rngs(0),
                              sparse=sparse)


# ------------------------------------------------------------------------- NumPy re-derivation (oracle)


def np_compress(k: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    """``k [S, D]`` → means of every complete window ``[stride*j, stride*j + kernel)``."""
    n = (len(k) - kernel) // stride + 1 if len(k) >= kernel else 0
    return np.stack([k[stride * j: stride * j + kernel].mean(0) for j in range(n)]) if n else np.zeros((0, k.shape[1]))


def np_scores(q: np.ndarray, k: np.ndarray, pos: int, sp: SparseConfig, scale: float) -> np.ndarray:
    """One query token ``q [G, D]`` (the heads of a group) at ``pos`` over keys ``k [L, D]`` (L > pos):
    ``score[j] = sum_h exp(q_h.K1[j]*scale - log sum_j' exp(q_h.K2[j']*scale))`` over whole windows at or
    before ``pos``; entries beyond stay 0."""
    k1 = np_compress(k, sp.kernel_size, sp.kernel_stride)
    k2 = np_compress(k, sp.kernel_size2, sp.kernel_stride2)
    out = np.zeros(len(k1))
    vis2 = [j for j in range(len(k2)) if j * sp.kernel_stride2 + sp.kernel_size2 - 1 <= pos]
    if not vis2:
        return out
    for h in range(q.shape[0]):
        s2 = np.array([q[h] @ k2[j] for j in vis2]) * scale
        lse = s2.max() + np.log(np.exp(s2 - s2.max()).sum())
        for j in range(len(k1)):
            if j * sp.kernel_stride + sp.kernel_size - 1 <= pos:
                out[j] += np.exp(q[h] @ k1[j] * scale - lse)
    return out


def np_selection(score: np.ndarray, pos: int, length: int, sp: SparseConfig) -> set[int]:
    """Blocks attended by a query at ``pos`` with ``length`` keys in the cache: a block scores the max
    over the compressed windows overlapping it; init and local blocks are forced; top
    ``topk + window/block`` among blocks up to the query's own."""
    q_blk = pos // sp.block_size
    n_blocks = -(-length // sp.block_size)
    scores = {}
    for b in range(n_blocks):
        if b < sp.init_blocks or q_blk - sp.window_size // sp.block_size <= b <= q_blk:
            scores[b] = np.inf
        elif b < q_blk:
            lo, hi = b * sp.block_size, (b + 1) * sp.block_size
            overl = [score[j] for j in range(len(score))
                     if j * sp.kernel_stride < hi and j * sp.kernel_stride + sp.kernel_size > lo]
            scores[b] = max(overl) if overl else -np.inf
    ranked = sorted(scores, key=lambda b: -scores[b])
    return set(ranked[: sp.topk + sp.window_size // sp.block_size])


def _random_caches(seed, b, kvh, s, d, sp: SparseConfig, planted=None):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    if planted is not None:
        planted(k, rng)
    k1 = np.zeros((b, kvh, -(-s // sp.kernel_stride), d), np.float32)
    k2 = np.zeros((b, kvh, max(16, -(-s // sp.kernel_stride2)), d), np.float32)
    for i in range(b):
        for g in range(kvh):
            c1, c2 = np_compress(k[i, g], sp.kernel_size, sp.kernel_stride), np_compress(k[i, g], sp.kernel_size2,
                                                                                        sp.kernel_stride2)
            k1[i, g, : len(c1)], k2[i, g, : len(c2)] = c1, c2
    return k, k1, k2


def _score_kw(sp):
    return dict(kernel1=sp.kernel_size, stride1=sp.kernel_stride, kernel2=sp.kernel_size2, stride2=sp.kernel_stride2)


# ------------------------------------------------------------------------------------ stage 1 + selection


def test_stage1_scores_and_selection_match_numpy_formulas():
    sp = SMALL
    b, kvh, group, d, s = 2, 2, 4, 16, 96
    k, k1, k2 = _random_caches(0, b, kvh, s, d, sp)
    rng = np.random.default_rng(1)
    positions = np.array([[3, 15, 16, 40, 63, 95], [0, 30, 47, 48, 70, 94]], np.int32)
    lengths = np.array([96, 95], np.int32)
    q = (rng.standard_normal((b, positions.shape[1], kvh * group, d)) * 0.5).astype(np.float32)
    scale = d**-0.5
    ref = np.asarray(compressed_scores_reference(jnp.asarray(q), jnp.asarray(k1), jnp.asarray(k2),
                                                 jnp.asarray(positions), scale=scale, **_score_kw(sp)))
    pallas = np.asarray(compressed_scores(jnp.asarray(q), jnp.asarray(k1), jnp.asarray(k2), jnp.asarray(positions),
                                          scale=scale, interpret=True, **_score_kw(sp)))
    blocks = np.asarray(select_blocks(jnp.asarray(ref), jnp.asarray(positions), jnp.asarray(lengths), sp,
                                      -(-s // sp.block_size)))
    for i in range(b):
        for g in range(kvh):
            for t, pos in enumerate(positions[i]):
                want = np_scores(q[i, t, g * group:(g + 1) * group], k[i, g, : lengths[i]], pos, sp, scale)
                n = len(want)
                np.testing.assert_allclose(ref[i, g, t, :n], want, rtol=2e-5, atol=1e-7)
                visible = (np.arange(n) * sp.kernel_stride + sp.kernel_size - 1) <= pos
                np.testing.assert_allclose(pallas[i, g, t, :n][visible], want[visible], rtol=2e-5, atol=1e-7)
                got = set(int(x) for x in blocks[i, g, t] if x >= 0)
                assert got == np_selection(want, pos, lengths[i], sp), (i, g, t, pos)
                # ascending, valid entries first
                row = list(blocks[i, g, t])
                assert row == sorted(x for x in row if x >= 0) + [-1] * row.count(-1)


def test_selector_always_finds_a_planted_block():
    """Synthetic needle: one old block's keys align with the query; it must be selected at every later
    position, for every seed, although it is neither an init nor a local block."""
    sp = SMALL
    d, s = 16, 128
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        direction = rng.standard_normal(d).astype(np.float32)
        direction /= np.linalg.norm(direction)
        needle = int(rng.integers(sp.init_blocks + 1, 8))

        def plant(k, rng):
            k *= 0.3
            k[0, :, needle * sp.block_size:(needle + 1) * sp.block_size] += 4.0 * direction

        k, k1, k2 = _random_caches(seed, 1, 1, s, d, sp, plant)
        positions = np.arange(96, 128, dtype=np.int32)[None]
        q = np.broadcast_to(3.0 * direction, (1, positions.shape[1], 4, d)) + 0.3 * rng.standard_normal(
            (1, positions.shape[1], 4, d))
        scores = compressed_scores_reference(jnp.asarray(q, jnp.float32), jnp.asarray(k1), jnp.asarray(k2),
                                             jnp.asarray(positions), scale=d**-0.5, **_score_kw(sp))
        blocks = np.asarray(select_blocks(scores, jnp.asarray(positions), jnp.asarray([s]), sp, s // sp.block_size))
        assert all(needle in row for row in blocks[0, 0]), (seed, needle)


# --------------------------------------------------------------------------------------------- stage 2


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_block_sparse_kernel_matches_reference(splits):
    rng = np.random.default_rng(2)
    b, t, h, kvh, d, s, bs = 2, 5, 8, 2, 16, 100, 8  # s not a multiple of the block: clamped last block
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, b, kvh, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, b, kvh, s, d)), jnp.float32)
    positions = jnp.asarray([[3, 10, 30, 60, 99], [0, 1, 2, 50, 97]], jnp.int32)
    lengths = jnp.asarray([100, 98], jnp.int32)
    blocks = np.full((b, kvh, t, 6), -1, np.int32)
    for idx in np.ndindex(b, kvh, t):
        q_blk = int(positions[idx[0], idx[2]]) // bs
        chosen = sorted(rng.choice(q_blk + 1, size=min(q_blk + 1, int(rng.integers(1, 7))), replace=False))
        blocks[idx][: len(chosen)] = chosen
    blocks = jnp.asarray(blocks)
    ref = block_sparse_attention_reference(q, k, v, positions, lengths, blocks, scale=0.3, block_size=bs, layer=2)
    got = block_sparse_attention(q, k, v, positions, lengths, blocks, scale=0.3, block_size=bs, layer=2,
                                 num_splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)
    # all blocks selected = dense causal attention
    every = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (b, kvh, t, 13))
    every = jnp.where(every <= positions[:, None, :, None] // bs, every, -1)
    every = jnp.sort(jnp.where(every < 0, 99, every), axis=-1)
    every = jnp.where(every == 99, -1, every)
    from pallas_kernels.attention import attention_reference
    dense = attention_reference(q, k, v, positions, lengths, scale=0.3, layer=2)
    np.testing.assert_allclose(np.asarray(block_sparse_attention(q, k, v, positions, lengths, every, scale=0.3,
                                                                 block_size=bs, layer=2, interpret=True)),
                               np.asarray(dense), atol=2e-6)


def test_compress_step_kernel_matches_reference_and_the_general_update():
    """The one-token compressed-cache update: Pallas kernel (interpret mode) = jnp reference = the general
    chunk update, for rows that complete a fine window, a coarse one, both, none, or did not grow."""
    from minicpm_jax.cache import KVCache
    from minicpm_jax.sparse import extend_compressed
    from pallas_kernels.sparse_attention import compress_step, compress_step_reference

    rng = np.random.default_rng(9)
    k = jnp.asarray(rng.standard_normal((3, 5, 2, 64, 16)), jnp.float32)
    k1 = jnp.asarray(rng.standard_normal((3, 5, 2, 32, 16)), jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((3, 5, 2, 16, 16)), jnp.float32)
    old, new = jnp.array([3, 15, 20, 40, 2]), jnp.array([4, 16, 20, 41, 3])
    kw = dict(layer=1, kernel1=4, stride1=2, kernel2=16, stride2=8)
    ref = compress_step_reference(k, k1, k2, old, new, **kw)
    got = compress_step(k, k1, k2, old, new, interpret=True, **kw)
    cache = extend_compressed(KVCache(k=k, v=k, lengths=old, k1=k1, k2=k2), 1, old, new, SMALL, max_tokens=1)
    for r, g, general, before in zip(ref, got, (cache.k1, cache.k2), (k1, k2)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        np.testing.assert_allclose(np.asarray(general), np.asarray(r), rtol=1e-6, atol=1e-7)
    changed = [int(jnp.sum(jnp.any(r != b, axis=-1))) for r, b in zip(ref, (k1, k2))]
    assert changed == [2 * 2, 1 * 2]  # rows 0 (j=0) and 1 (j=6) in K1; row 1 (j=0) in K2; 2 KV heads each


# ------------------------------------------------------------------------------------------- the model


_forward = jax.jit(lambda m, c, x: m(x, c))


def _ids(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 97, (1, n)), jnp.int32)


def test_compressed_caches_extend_exactly_over_a_300_token_decode():
    model = _model(max_length=320)
    sp = model.sparse
    cache = model.new_cache(1)
    step = jax.jit(lambda m, c, x: m(x, c)[2])
    cache = step(model, cache, _ids(8)[:, :7])
    tokens = np.random.default_rng(3).integers(0, 97, 300)
    for n, tok in enumerate(tokens):
        cache = step(model, cache, jnp.asarray([[tok]], jnp.int32))
        length = 8 + n
        assert int(cache.lengths[0]) == length
        k = np.asarray(cache.k[:, 0, :, :length])  # [L, KVH, length, D]
        for name, kernel, stride in (("k1", sp.kernel_size, sp.kernel_stride), ("k2", sp.kernel_size2, sp.kernel_stride2)):
            comp = np.asarray(getattr(cache, name)[:, 0])
            for layer in range(k.shape[0]):
                for g in range(k.shape[1]):
                    want = np_compress(k[layer, g], kernel, stride)
                    np.testing.assert_allclose(comp[layer, g, : len(want)], want, rtol=1e-6, atol=1e-7,
                                               err_msg=f"{name} layer {layer} step {n}")


def test_sparse_equals_dense_below_dense_len_and_when_topk_covers_every_block():
    ids = _ids(100)
    dense = _model(sparse="off")
    want, _, _ = dense(ids, dense.new_cache(1))
    # (1) context below dense_len: the dense path
    below = _model(sparse=dataclasses.replace(SMALL, dense_len=101))
    got, _, _ = below(ids, below.new_cache(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # (2) sparse from token 32 on, but topk covers all 13 blocks
    covered = _model(sparse=dataclasses.replace(SMALL, topk=16))
    got, _, cache = covered(ids, covered.new_cache(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # (3) the real selection (5 of up to 13 blocks) differs past position 5*8 = 40
    sparse = _model()
    got, _, _ = sparse(ids, sparse.new_cache(1))
    np.testing.assert_allclose(np.asarray(got[:, :40]), np.asarray(want[:, :40]), atol=1e-5)
    assert float(jnp.max(jnp.abs(got[:, 48:] - want[:, 48:]))) > 1e-3


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sparse_prefill_last_logits_equal_sparse_decode(impl):
    model = _model(impl=impl)
    ids = _ids(90, seed=4)
    full, _, _ = _forward(model, model.new_cache(1), ids)
    # the prefix in chunks of 16, then the last token as a decode step
    cache = model.new_cache(1)
    for start in range(0, 89, 16):
        chunk = ids[:, start:min(start + 16, 89)]
        _, _, cache = _forward(model, cache, chunk)
    last, _, _ = _forward(model, cache, ids[:, 89:])
    np.testing.assert_allclose(np.asarray(last[0, -1]), np.asarray(full[0, -1]), rtol=1e-4, atol=1e-5)


def test_pallas_sparse_model_matches_xla():
    ids = _ids(100, seed=5)
    ref, _, _ = (m := _model(impl="xla"))(ids, m.new_cache(1))
    got, _, _ = (m := _model(impl="pallas"))(ids, m.new_cache(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


def test_use_nope_selects_on_pre_rope_keys():
    """With use_nope the compressed caches hold means of pre-RoPE keys (recovered by rotating back)."""
    model = _model(sparse=dataclasses.replace(SMALL, use_nope=True))
    ids = _ids(60, seed=6)
    _, _, cache = model(ids, model.new_cache(1))
    attn = model.model.layers[0].self_attn
    cfg = model.config
    x = model.model.layers[0].input_layernorm(
        model.model.embed_tokens(ids).astype(jnp.float32) * cfg.scale_emb)
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    k_nope = np.asarray(attn.qkv_proj(x)[0, :, nq:nq + nkv].reshape(60, cfg.num_kv_heads, cfg.head_dim))
    for g in range(cfg.num_kv_heads):
        want = np_compress(k_nope[:, g], SMALL.kernel_size, SMALL.kernel_stride)
        np.testing.assert_allclose(np.asarray(cache.k1[0, 0, g, : len(want)]), want, rtol=1e-4, atol=1e-5)
    dense = _model(sparse="off")
    a, _, _ = model(ids, model.new_cache(1))
    b, _, _ = dense(ids, dense.new_cache(1))
    assert float(jnp.max(jnp.abs(a[:, 48:] - b[:, 48:]))) > 1e-3  # sparse from 32, selection differs


def test_generation_mixes_dense_and_sparse_rows_in_one_batch():
    """End to end through the engine: a batch with one prompt below dense_len (it crosses dense_len while
    decoding) and one above, greedy, equals each prompt generated alone by plain model calls (which pick
    the attention per row on device). The engine picked dense, mixed and sparse steps on the host."""
    model = _model()
    engine = Engine(model, batch_size=2, chunk_length=16)
    prompts = [list(np.random.default_rng(7).integers(3, 97, 12)), list(np.random.default_rng(8).integers(3, 97, 50))]
    outs, _ = engine.generate(prompts, sampling=SamplingParams(temperature=0.0), max_new_tokens=30)
    for prompt, out in zip(prompts, outs):
        cache = model.new_cache(1)
        logits, _, cache = _forward(model, cache, jnp.asarray([prompt], jnp.int32))
        want = []
        for _ in range(30):
            tok = int(jnp.argmax(logits[0, -1]))
            if tok in model.config.eos_token_ids:
                break
            want.append(tok)
            logits, _, cache = _forward(model, cache, jnp.asarray([[tok]], jnp.int32))
        assert out.token_ids[: len(want)] == want and len(want) > 0
    modes = {dict(key[2]).get("mode") for key in engine._executables if key[0] in ("prefill", "decode")}
    assert modes == {"dense", "mixed", "sparse"}


# ---------------------------------------------------------------------------------------------- settings


def test_attention_mode_and_inactive_models():
    assert [attention_mode(32, lo, hi) for lo, hi in ((40, 50), (10, 31), (10, 32), (31, 40))] == [
        "sparse", "dense", "mixed", "mixed"]
    short = _model(max_length=24)  # never reaches dense_len 32: a plain dense model, no compressed caches
    assert not short.sparse_active and short.new_cache(1).k1 is None
    assert _model().sparse_active and _model().new_cache(1).k1.shape == (3, 1, 2, 64, 16)


def test_resolve_sparse_modes_overrides_and_errors():
    cfg = _config()
    assert resolve_sparse(cfg, "auto") == SMALL
    assert resolve_sparse(cfg, "off") is None
    plain = _config(None)
    assert resolve_sparse(plain, "auto") is None
    assert resolve_sparse(plain, "on") == SparseConfig()  # MiniCPM4 defaults
    got = resolve_sparse(cfg, "on", topk=7, window_size=32, dense_len=64)
    assert (got.topk, got.window_size, got.dense_len, got.num_selected) == (7, 32, 64, 11)
    with pytest.raises(MiniCPMError, match="kernel_size == 2"):
        resolve_sparse(cfg, SparseConfig(kernel_size=5, kernel_stride=2, block_size=8))
    with pytest.raises(MiniCPMError, match="topk must be >= 1"):
        resolve_sparse(cfg, "on", topk=0)
    with pytest.raises(MiniCPMError, match="sparse must be one of"):
        resolve_sparse(cfg, "sometimes")
    model = _model()
    with pytest.raises(MiniCPMError, match="new_cache"):
        from minicpm_jax.cache import KVCache
        model(_ids(4), KVCache.create(model.config, 1, MAX_LEN, jnp.float32))
