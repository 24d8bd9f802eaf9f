"""The paged KV cache against the contiguous one: the same model over a pool whose pages are scattered,
shared between rows and full of garbage elsewhere gives the contiguous cache's logits, through prompt
chunks, decode steps, speculative trees and the commit of their accepted paths."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.paged_cache import PagedKVCache
from tests.helpers import SMALL, random_tree, tiny_minicpm_config

MAX_LEN = 96
PAGE = 16
PAGES_PER_ROW = MAX_LEN // PAGE


# InfLLM-v2 with 16-token blocks (= pages): windows 8/4 and 32/16, 2 local blocks + top-3 (one block or more
# picked by score past 80 tokens); sparse from 48 tokens.
SPARSE = SparseConfig(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=PAGE, window_size=2 * PAGE, topk=3,
                      use_nope=False, dense_len=48)
SPARSE_LEN = 128  # 8 blocks: a query attends at most 5


_forward = jax.jit(lambda model, tokens, cache, *args, **kwargs: model(tokens, cache, *args, **kwargs))


class Jitted:
    """The model with each forward one jitted program, as the engine runs it (eager op-by-op dispatch made
    this module ~3.5x slower on the CPU for the same numbers); everything else is the model's own."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens, cache, *args, **kwargs):
        return _forward(self.model, tokens, cache, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def sparse_model():
    config = ModelConfig.from_dict(tiny_minicpm_config(num_hidden_layers=2))
    return Jitted(MiniCPMForCausalLM(config, max_length=SPARSE_LEN, attention_impl="xla", dtype=jnp.float32,
                                     rngs=nnx.Rngs(5), sparse=SPARSE))


@pytest.fixture(scope="module")
def model():
    config = ModelConfig.from_dict(tiny_minicpm_config(num_hidden_layers=2))  # a layer's writes, then another's reads
    return Jitted(MiniCPMForCausalLM(config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32,
                                     rngs=nnx.Rngs(3)))


def _pool(model, batch, num_pages, table):
    """A paged view over a pool filled with NaN (every slot a row may not read must stay unread), compressed
    keys included."""
    cache = model.new_paged_cache(num_pages=num_pages, page_size=PAGE, batch_size=batch)
    nan = {name: jnp.full_like(x, jnp.nan) for name in ("k", "v", "k1", "k2")
           if (x := getattr(cache, name)) is not None}
    return dataclasses.replace(cache, page_table=jnp.asarray(table, jnp.int32), **nan)


def _scattered_table(rng, batch, num_pages, per_row=PAGES_PER_ROW):
    return rng.permutation(num_pages)[: batch * per_row].reshape(batch, per_row)


def _run(model, cache, prompts, steps):
    """Ragged prompts in two chunks, then greedy decode steps; returns (logits of every step, cache)."""
    b = len(prompts)
    width = max(map(len, prompts))
    tokens = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    n = np.asarray([len(p) for p in prompts], np.int32)
    half = width // 2
    out = []
    for lo, hi in ((0, half), (half, width)):
        valid = np.clip(n - lo, 0, hi - lo).astype(np.int32)
        logits, _, cache = model(jnp.asarray(tokens[:, lo:hi]), cache, jnp.asarray(valid))
        out.append(logits)
    last = jnp.take_along_axis(out[-1], jnp.asarray(np.clip(n - half - 1, 0, None))[:, None, None], axis=1)[:, 0]
    for _ in range(steps):
        tok = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]
        logits, _, cache = model(tok, cache)
        out.append(logits)
        last = logits[:, 0]
    return out, cache


def test_paged_forward_matches_contiguous(model):
    rng = np.random.default_rng(0)
    lengths = np.asarray([37, 5, 20])
    prompts = [rng.integers(0, 97, n) for n in lengths]
    want, contiguous = _run(model, model.new_cache(3), prompts, steps=4)
    got, paged = _run(model, _pool(model, 3, 24, _scattered_table(rng, 3, 24)), prompts, steps=4)
    assert np.asarray(paged.lengths).tolist() == np.asarray(contiguous.lengths).tolist() == [41, 9, 24]
    half = 37 // 2
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        for row in range(3):
            # Prompt chunks: the real tokens only (padding computes garbage, never stored or read).
            real = g.shape[1] if i >= 2 else int(np.clip(lengths[row] - i * half, 0, g.shape[1]))
            np.testing.assert_allclose(g[row, :real], w[row, :real], rtol=2e-5, atol=2e-5)


def test_rows_sharing_prefix_pages_read_them(model):
    """Row 1 starts where row 0's first two pages (the shared prompt) end: it computes only its own tail,
    reading the shared pages, and matches a contiguous run of its whole prompt."""
    rng = np.random.default_rng(1)
    shared = list(rng.integers(0, 97, 2 * PAGE))
    a, b = shared + list(rng.integers(0, 97, 7)), shared + list(rng.integers(0, 97, 11))
    table = np.asarray([[5, 2, 9, 0, 0, 0], [5, 2, 7, 0, 0, 0]], np.int32)
    cache = _pool(model, 2, 12, table)
    logits_a, _, row_a = model(jnp.asarray([a]), cache.take_rows(jnp.asarray([0])))
    cache = cache.put_rows(jnp.asarray([0]), row_a).with_lengths([len(a), 2 * PAGE])
    logits_b, _, _ = model(jnp.asarray([b[2 * PAGE:]]), cache.take_rows(jnp.asarray([1])))
    want_a, _, _ = model(jnp.asarray([a]), model.new_cache(1))
    want_b, _, _ = model(jnp.asarray([b]), model.new_cache(1))
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(want_a), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits_b[0]), np.asarray(want_b[0, 2 * PAGE:]), rtol=2e-5, atol=2e-5)


def test_tree_verification_and_commit_match_contiguous(model):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 97, n) for n in (30, 17)]
    _, contiguous = _run(model, model.new_cache(2), prompts, steps=0)
    _, paged = _run(model, _pool(model, 2, 16, _scattered_table(rng, 2, 16)), prompts, steps=0)
    t = 9
    trees = [random_tree(rng, t, 3) for _ in range(2)]
    depths = jnp.asarray(np.stack([d for d, _ in trees]), jnp.int32)
    mask = jnp.asarray(np.stack([m for _, m in trees]))
    tokens = jnp.asarray(rng.integers(0, 97, (2, t)), jnp.int32)
    want, _, contiguous = model(tokens, contiguous, tree=(depths, mask))
    got, _, paged = model(tokens, paged, tree=(depths, mask))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # Commit a path of each tree (root, then a child chain) and decode one token after it.
    paths = np.zeros((2, 4), np.int32)
    accepted = np.asarray([1, 1], np.int32)
    for row, (d, m) in enumerate(trees):
        deepest = int(np.argmax(d))
        chain = [j for j in range(t) if m[deepest, j]]
        paths[row, : len(chain)] = chain
        accepted[row] = len(chain)
    prefix = jnp.asarray([30, 17], jnp.int32)
    contiguous = contiguous.commit_path(prefix, jnp.asarray(paths), jnp.asarray(accepted))
    paged = paged.commit_path(prefix, jnp.asarray(paths), jnp.asarray(accepted))
    assert np.asarray(paged.lengths).tolist() == np.asarray(contiguous.lengths).tolist()
    nxt = jnp.asarray([[3], [4]], jnp.int32)
    want, _, _ = model(nxt, contiguous)
    got, _, _ = model(nxt, paged)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_take_and_put_rows_share_the_pool(model):
    cache = model.new_paged_cache(num_pages=8, page_size=PAGE, batch_size=3)
    rows = cache.take_rows(jnp.asarray([2]))
    assert rows.k is cache.k and rows.page_table.shape == (1, PAGES_PER_ROW) and rows.batch_size == 1
    _, _, rows = model(jnp.asarray([[1, 2, 3]]), rows)
    back = cache.put_rows(jnp.asarray([2]), rows)
    assert np.asarray(back.lengths).tolist() == [0, 0, 3] and back.k is rows.k


def test_paged_cache_sizes_and_sparse_geometry(model, sparse_model):
    cfg = model.config
    page = PagedKVCache.page_nbytes(cfg, PAGE, jnp.float32)
    assert page == 2 * PAGE * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert PagedKVCache.nbytes(cfg, 10, PAGE, 2, jnp.float32) == 10 * page + 2 * 64 * page // PAGE
    # A sparse page also holds its 16/4 fine and 16/16 coarse compressed keys.
    sparse_page = PagedKVCache.page_nbytes(cfg, PAGE, jnp.float32, sparse=SPARSE)
    assert sparse_page == page * (2 * PAGE + 4 + 1) // (2 * PAGE)
    cache = sparse_model.new_paged_cache(num_pages=10, page_size=PAGE, batch_size=2)
    assert sum(x.nbytes for x in (cache.k, cache.v, cache.k1, cache.k2)) == \
        PagedKVCache.nbytes(cfg, 10, PAGE, 2, jnp.float32, sparse=SPARSE)
    small = MiniCPMForCausalLM(cfg, max_length=64, attention_impl="xla", sparse=SMALL, dtype=jnp.float32)
    assert small.sparse_active
    with pytest.raises(MiniCPMError, match="pages of one sparse block .8 tokens.*--page_size 8"):
        small.new_paged_cache(num_pages=4, page_size=PAGE, batch_size=1)


def test_sparse_paged_forward_matches_contiguous(sparse_model):
    """InfLLM-v2 over pages (compressed keys in the pages, blocks = pages): prompt chunks across dense_len
    (mixed steps) and decode steps give the contiguous cache's logits, with NaN in every unwritten slot."""
    rng = np.random.default_rng(6)
    lengths = np.asarray([100, 21, 70])
    prompts = [rng.integers(0, 97, n) for n in lengths]
    per_row = SPARSE_LEN // PAGE
    want, contiguous = _run(sparse_model, sparse_model.new_cache(3), prompts, steps=4)
    got, paged = _run(sparse_model, _pool(sparse_model, 3, 30, _scattered_table(rng, 3, 30, per_row)), prompts,
                      steps=4)
    assert np.asarray(paged.lengths).tolist() == np.asarray(contiguous.lengths).tolist() == [104, 25, 74]
    half = 100 // 2
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        for row in range(3):
            real = g.shape[1] if i >= 2 else int(np.clip(lengths[row] - i * half, 0, g.shape[1]))
            np.testing.assert_allclose(g[row, :real], w[row, :real], rtol=2e-5, atol=2e-5)


def test_sparse_rows_sharing_prefix_pages_share_their_compressed_keys(sparse_model):
    """Row 1 starts after row 0's first three pages (a shared prompt): its sparse steps select among the
    shared pages by the compressed keys row 0 wrote there, and match a contiguous run of its whole prompt."""
    rng = np.random.default_rng(7)
    shared = list(rng.integers(0, 97, 3 * PAGE))
    a, b = shared + list(rng.integers(0, 97, 30)), shared + list(rng.integers(0, 97, 45))
    table = np.asarray([[5, 2, 9, 11, 3, 0, 0, 0], [5, 2, 9, 7, 1, 4, 0, 0]], np.int32)
    cache = _pool(sparse_model, 2, 12, table)
    _, _, row_a = sparse_model(jnp.asarray([a]), cache.take_rows(jnp.asarray([0])))
    cache = cache.put_rows(jnp.asarray([0]), row_a).with_lengths([len(a), 3 * PAGE])
    logits_b, _, rows = sparse_model(jnp.asarray([b[3 * PAGE:]]), cache.take_rows(jnp.asarray([1])))
    step_b, _, _ = sparse_model(jnp.asarray([[9]]), rows)
    want_b, _, whole = sparse_model(jnp.asarray([b]), sparse_model.new_cache(1))
    want_step, _, _ = sparse_model(jnp.asarray([[9]]), whole)
    np.testing.assert_allclose(np.asarray(logits_b[0]), np.asarray(want_b[0, 3 * PAGE:]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(step_b), np.asarray(want_step), rtol=2e-5, atol=2e-5)


def test_sparse_tree_verification_and_commit_match_contiguous(sparse_model):
    """Speculative trees of a sparse model over pages: each node verified as sparse decoding of its path
    would, then the accepted paths committed and their compressed keys extended, as on the contiguous cache."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 97, n) for n in (70, 57)]
    _, contiguous = _run(sparse_model, sparse_model.new_cache(2), prompts, steps=0)
    per_row = SPARSE_LEN // PAGE
    _, paged = _run(sparse_model, _pool(sparse_model, 2, 20, _scattered_table(rng, 2, 20, per_row)), prompts, steps=0)
    t = 7
    trees = [random_tree(rng, t, 3) for _ in range(2)]
    depths = jnp.asarray(np.stack([d for d, _ in trees]), jnp.int32)
    mask = jnp.asarray(np.stack([m for _, m in trees]))
    tokens = jnp.asarray(rng.integers(0, 97, (2, t)), jnp.int32)
    want, _, contiguous = sparse_model(tokens, contiguous, tree=(depths, mask))
    got, _, paged = sparse_model(tokens, paged, tree=(depths, mask))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    paths = np.zeros((2, 4), np.int32)
    accepted = np.ones(2, np.int32)
    for row, (d, m) in enumerate(trees):
        chain = [j for j in range(t) if m[int(np.argmax(d)), j]]
        paths[row, : len(chain)] = chain
        accepted[row] = len(chain)
    prefix = jnp.asarray([70, 57], jnp.int32)
    new = prefix + jnp.asarray(accepted)
    caches = [c.commit_path(prefix, jnp.asarray(paths), jnp.asarray(accepted)) for c in (contiguous, paged)]
    caches = [sparse_model.extend_compressed(c, prefix, new, 4) for c in caches]
    want, got = (sparse_model(jnp.asarray([[3], [4]], jnp.int32), c)[0] for c in caches)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_int4_weights_decode_the_same_tokens_on_both_caches():
    """The cache kind is independent of the weights' format: a W4A16 model generates the same greedy tokens
    over the paged pool as over the contiguous cache (rows of mixed lengths)."""
    from minicpm_jax.engine.engine import Engine
    from minicpm_jax.engine.paging import Paging
    from minicpm_jax.quant import QuantSpec

    config = ModelConfig.from_dict(tiny_minicpm_config(num_hidden_layers=2))
    model = MiniCPMForCausalLM(config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(4),
                               quant=QuantSpec(group_size=16))
    prompts = [[5, 9, 2, 44] * 5, [7, 8]]
    want, _ = Engine(model, batch_size=2, chunk_length=16).generate(prompts, max_new_tokens=6)
    paged = Engine(model, batch_size=2, chunk_length=16, paging=Paging(num_pages=12, page_size=PAGE))
    got, _ = paged.generate(prompts, max_new_tokens=6)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]

