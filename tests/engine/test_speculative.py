"""EAGLE speculative decoding: lossless greedy and sampled decoding against plain decoding, KV compaction,
FR-Spec, EAGLE-3 and int4 drafts, sparse targets, draft checkpoints and converters. The tree-attention
kernel: ``tests/kernels/test_tree_attention.py``."""

import dataclasses
import pickle
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.engine.speculative.engine import SpeculativeEngine
from minicpm_jax.engine.speculative.rounds import SpecConfig, SpecState, catch_up, tree_masks
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.frspec import read_frspec
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.loading import load_draft, save_draft
from tests.helpers import tiny_minicpm_config

MAX_LEN = 96
VOCAB = 24


def test_tree_masks_are_ancestor_sets():
    parent = jnp.asarray([[0, 0, 0, 1, 3, 2]])
    got = np.asarray(tree_masks(parent, 4))[0]
    want = np.zeros((6, 6), bool)
    for i in range(6):
        j = i
        want[i, 0] = True
        while j:
            want[i, j] = True
            j = int(parent[0, j])
    np.testing.assert_array_equal(got, want)


def _bigram_pair(seed=0, sparse="off", max_length=MAX_LEN, attention_impl="xla"):
    """A target whose next token mostly follows the current one (small layers over a sharp embedding →
    lm_head path) and a draft that predicts that bigram, so trees are often accepted several levels deep."""
    cfg = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=VOCAB))
    model = MiniCPMForCausalLM(cfg, max_length=max_length, attention_impl=attention_impl, dtype=jnp.float32,
                               rngs=nnx.Rngs(seed), sparse=sparse)
    gd, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        name = ".".join(map(str, path))
        scale = 60.0 if "embed_tokens" in name or "lm_head" in name else (3.0 if "layers" in name else 1.0)
        var.set_value(var[...] * scale)
    model = nnx.merge(gd, nnx.from_flat_state(flat))
    draft = EagleDraft(DraftSpec.for_target(cfg), max_length=max_length, attention_impl=attention_impl,
                       dtype=jnp.float32, rngs=nnx.Rngs(seed + 1))
    h = cfg.hidden_size
    draft.fc.kernel.set_value(jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], axis=0) * 4.0)
    for lin in (draft.self_attn.o_proj, draft.mlp.down_proj):
        lin.kernel.set_value(lin.kernel[...] * 0.05)
    return model, draft


@pytest.fixture(scope="module")
def pair():
    return _bigram_pair()


PROMPTS = [[3, 7, 9, 11, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def plain_greedy(pair):
    model, _ = pair
    out, _ = Engine(model, batch_size=2, chunk_length=16).generate(PROMPTS, max_new_tokens=30)
    return [r.token_ids for r in out]


@pytest.mark.parametrize("spec", [
    SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16),
    SpecConfig(num_iter=4, topk_per_iter=8, tree_size=64, window_size=5),
    SpecConfig(num_iter=1, topk_per_iter=1, tree_size=1),  # root only: plain decoding
], ids=["tree16", "tree64-window", "root-only"])
def test_greedy_speculative_equals_plain_greedy(pair, plain_greedy, spec):
    model, draft = pair
    engine = SpeculativeEngine(model, draft, spec=spec, batch_size=2, chunk_length=16, decode_block=3)
    out, stats = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in out] == plain_greedy
    assert all(r.finish_reason == "length" for r in out)
    summary = stats.spec_summary()
    if spec.tree_size == 1:
        assert summary["mean_accept_length"] == 1.0
    else:  # the bigram draft is usually right: several tokens per round
        assert summary["mean_accept_length"] > 1.8, summary
    assert stats.decode_tokens == 2 * 29


def test_frspec_subset_keeps_greedy_output(pair, plain_greedy):
    model, draft = pair
    ids = np.array([5, 1, 9, 7, 3, 11, 0, 2, 4, 6, 8, 10, 12, 13], np.int32)
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=20),
                               frspec_ids=ids, batch_size=2, chunk_length=16)
    out, _ = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in out] == plain_greedy


@pytest.fixture(scope="module")
def eagle3_draft(pair):
    """A random EAGLE-3 draft over a 16-id draft vocabulary (d2t maps it onto scattered target ids)."""
    model, _ = pair
    spec = DraftSpec.for_target(model.config, "eagle3", draft_vocab=16)
    draft = EagleDraft(spec, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(5))
    used = np.sort(np.random.default_rng(0).choice(VOCAB, 16, replace=False))
    draft.d2t.set_value(jnp.asarray(used - np.arange(16), jnp.int32))
    return draft


def test_eagle3_greedy_speculative_equals_plain_greedy(pair, plain_greedy, eagle3_draft):
    model, _ = pair
    assert eagle3_draft.spec.capture == (2, 1, 0) and eagle3_draft.spec.feature_size == 3 * model.config.hidden_size
    engine = SpeculativeEngine(model, eagle3_draft, spec=SpecConfig(num_iter=3, topk_per_iter=6, tree_size=24),
                               batch_size=2, chunk_length=16)
    out, stats = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in out] == plain_greedy
    assert stats.spec_summary()["mean_accept_length"] > 1.0  # a random draft is sometimes right
    with pytest.raises(MiniCPMError, match="FR-Spec"):
        SpeculativeEngine(model, eagle3_draft, frspec_ids=np.arange(8))
    with pytest.raises(MiniCPMError, match="exceeds the draft's vocabulary of 16"):
        SpeculativeEngine(model, eagle3_draft, spec=SpecConfig(num_iter=2, topk_per_iter=20, tree_size=12))


def test_captured_features_are_the_residual_stream_entering_each_layer(pair):
    model, _ = pair
    tokens = jnp.asarray([PROMPTS[1]])
    _, captured, _ = model.forward_features(tokens, model.new_cache(1), capture=(0, 2))
    x = model.model.embed_tokens(tokens) * model.config.scale_emb
    np.testing.assert_allclose(np.asarray(captured[0]), np.asarray(x), rtol=1e-6)
    cache = model.new_cache(1)
    positions = jnp.arange(tokens.shape[1])[None]
    valid = jnp.ones(tokens.shape, bool)
    lengths = jnp.asarray([tokens.shape[1]])
    for layer in model.model.layers[:2]:
        x, cache = layer(x, positions, valid, cache, lengths)
    np.testing.assert_allclose(np.asarray(captured[1]), np.asarray(x), rtol=1e-5, atol=1e-5)


def test_stop_ids_and_budgets_inside_a_round(pair, plain_greedy):
    model, draft = pair
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=4, topk_per_iter=4, tree_size=24), batch_size=2,
                               chunk_length=16)
    stop = plain_greedy[0][6]
    first = plain_greedy[0].index(stop)
    out, _ = engine.generate(PROMPTS, max_new_tokens=[30, 11], stop_token_ids=[[stop], []])
    assert out[0].token_ids == plain_greedy[0][: first + 1] and out[0].finish_reason == "stop"
    assert out[1].token_ids == plain_greedy[1][:11] and out[1].finish_reason == "length"


def test_compacted_cache_equals_recomputed_cache(pair):
    model, draft = pair
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16), batch_size=1,
                               chunk_length=16)
    [res], stats = engine.generate([PROMPTS[1]], max_new_tokens=25)
    assert stats.spec_summary()["mean_accept_length"] > 1.5
    committed = PROMPTS[1] + res.token_ids[:-1]
    assert engine.cache_lengths() == [len(committed)]
    fresh = model.new_cache(1)
    _, _, fresh = model(jnp.asarray([committed]), fresh)
    n = len(committed)
    np.testing.assert_allclose(np.asarray(engine.cache.k[:, :, :, :n]), np.asarray(fresh.k[:, :, :, :n]), atol=2e-4)
    np.testing.assert_allclose(np.asarray(engine.cache.v[:, :, :, :n]), np.asarray(fresh.v[:, :, :, :n]), atol=2e-4)


def test_a_row_with_no_pending_pair_expands_its_tree_from_a_zero_hidden(pair):
    """A finished row (nothing pending) still expands a tree inside a block; its hidden is zero, not its
    masked query's output, whose tree K/V sit in the draft cache past the row's length (with bf16 random
    weights of benchmarks.shapes' tiny shape, int4, the tree's hiddens were NaN, and a later read weighting
    them by zero turned NaN too)."""
    model, draft = pair
    a, h = 3, model.config.hidden_size
    rng = np.random.default_rng(0)
    dcache = draft.new_cache(2, MAX_LEN)
    dcache = dcache.with_lengths(jnp.asarray([6, 6], jnp.int32))
    tok = jnp.asarray(rng.integers(0, VOCAB, (2, a)), jnp.int32)
    feat = jnp.asarray(rng.normal(size=(2, a, h)) * 30, jnp.float32)

    def last(pend_n):
        st = SpecState(dcache=dcache, pend_tok=tok, pend_feat=feat, pend_n=jnp.asarray(pend_n, jnp.int32),
                       accepted=jnp.zeros((2, a + 1), jnp.int32))
        return np.asarray(catch_up(model, draft, st, None)[0])

    both, one = last([2, 2]), last([0, 2])
    assert np.abs(both[0]).max() > 0
    np.testing.assert_array_equal(one[0], 0.0)
    np.testing.assert_allclose(one[1], both[1], rtol=1e-6)  # the other row is its own


def test_commit_path_moves_path_rows():
    cfg = ModelConfig.from_dict(tiny_minicpm_config())
    from minicpm_jax.model.cache import KVCache
    cache = KVCache.create(cfg, 2, 32, jnp.float32)
    marks = jnp.arange(32, dtype=jnp.float32)[None, None, None, :, None]
    cache = KVCache(k=jnp.broadcast_to(marks, cache.k.shape), v=-jnp.broadcast_to(marks, cache.v.shape),
                    lengths=cache.lengths)
    out = cache.commit_path(jnp.asarray([10, 4]), jnp.asarray([[0, 3, 5], [0, 2, 0]]), jnp.asarray([3, 2]))
    assert list(np.asarray(out.lengths)) == [13, 6]
    k = np.asarray(out.k[0, :, 0, :, 0])
    assert list(k[0, 10:14]) == [10, 13, 15, 13] and list(k[1, 4:7]) == [4, 6, 6]
    assert list(np.asarray(out.v[0, 0, 0, 10:13, 0])) == [-10, -13, -15]


def test_multi_turn_reuse_with_draft(pair):
    model, draft = pair
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16), batch_size=1,
                               chunk_length=16)
    plain = Engine(model, batch_size=1, chunk_length=16)
    [first], _ = engine.generate([PROMPTS[0]], max_new_tokens=8)
    follow = PROMPTS[0] + first.token_ids + [3, 4, 5]
    [again], _ = engine.generate([follow], max_new_tokens=12, reuse_prefix=True)
    [want], _ = plain.generate([follow], max_new_tokens=12)
    assert again.token_ids == want.token_ids


def test_sampled_speculative_tokens_have_the_target_distribution(pair):
    """Over 2048 seeds, the second token (the first one a speculative round emits) follows the exact
    target marginal sum_t1 p(t1) p(t2 | t1): chi-square test at p > 0.01."""
    from scipy import stats as sps
    model, draft = pair
    prompt = [3, 7, 9]
    # Temperature 4 spreads the target's distribution out.
    cache = model.new_cache(1)
    logits, _, cache0 = model(jnp.asarray([prompt]), cache)
    p1 = np.asarray(jax.nn.softmax(logits[0, -1] / 4.0), np.float64)
    # Every first token t1 at once: one forward over the VOCAB continuations (rows are independent).
    lg, _, _ = model(jnp.asarray([prompt + [t1] for t1 in range(VOCAB)]), model.new_cache(VOCAB))
    p2 = p1 @ np.asarray(jax.nn.softmax(lg[:, -1] / 4.0), np.float64)
    rows = 256
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=2, topk_per_iter=4, tree_size=10),
                               batch_size=rows, chunk_length=16, decode_block=1)
    seconds = []
    for batch in range(8):
        samplings = [SamplingParams(temperature=4.0, seed=batch * rows + i) for i in range(rows)]
        out, _ = engine.generate([prompt] * rows, sampling=samplings, max_new_tokens=2)
        seconds += [r.token_ids[1] for r in out]
    p2 /= p2.sum()
    counts = np.bincount(seconds, minlength=VOCAB)
    expected = p2 * len(seconds)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert sps.chisquare(obs, exp).pvalue > 0.01
    assert big.sum() >= 5  # a spread-out distribution, so the test has power


def _sparse_pair(use_nope: bool, max_length: int = 128, block_size: int = 8):
    """The bigram pair with an InfLLM-v2 target whose sparse attention starts at 24 tokens and attends 6
    blocks of 8 (init + 3 local + 2 selected), so selection decides outputs from 48 tokens on
    (``block_size=16``, pages of a paged cache: windows 8/4, init + 2 local + 2 selected blocks of 16, so
    selection decides from 80 tokens on)."""
    model, draft = _bigram_pair(max_length=max_length)
    small = dict(kernel_size=4, kernel_stride=2, window_size=16) if block_size == 8 else \
        dict(kernel_size=8, kernel_stride=4, window_size=32)
    cfg = ModelConfig.from_dict(tiny_minicpm_config(
        vocab_size=VOCAB, sparse_config={**small, "init_blocks": 1, "block_size": block_size, "topk": 4,
                                         "use_nope": use_nope, "dense_len": 24}))
    sparse_model = MiniCPMForCausalLM(cfg, max_length=max_length, attention_impl="xla", dtype=jnp.float32,
                                      rngs=nnx.Rngs(0), sparse="on")
    return nnx.merge(nnx.graphdef(sparse_model), nnx.state(model)), draft


@pytest.mark.parametrize("use_nope", [False, True], ids=["rope", "nope"])
def test_sparse_target_speculative_equals_plain_sparse_greedy_across_dense_len(use_nope):
    """Rows start dense, cross dense_len at different rounds (mixed trees) and decode sparse: every tree
    node is verified as plain sparse decoding of its path, the accepted path's K1/K2 are appended, so the
    tokens equal plain sparse greedy decoding and the caches equal the plain engine's.

    With ``use_nope`` this model's repeated bigram cycles give identical pre-RoPE windows, i.e. block scores
    tied in exact arithmetic that fp32 rounding breaks either way (seen: 0.5063322 vs 0.5063323), so there
    only the tokens and the attention-independent layer-0 K1/K2 are compared; the per-node exactness with
    ``use_nope`` is ``tests/model/test_sparse_model.py::test_tree_sparse_attention_equals_plain_sparse_decoding_of_each_path``."""
    model, draft = _sparse_pair(use_nope)
    assert model.sparse_active
    plain = Engine(model, batch_size=2, chunk_length=16)
    want, _ = plain.generate(PROMPTS, max_new_tokens=80)
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16),
                               batch_size=2, chunk_length=16)
    got, stats = engine.generate(PROMPTS, max_new_tokens=80)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats.spec_summary()["mean_accept_length"] > 1.5  # multi-token paths were verified
    lengths = np.minimum(np.asarray(engine.cache.lengths), np.asarray(plain.cache.lengths))
    assert lengths.min() > 64
    # Keys of layers > 0 carry the attention of the layers below: equal to plain sparse decoding's, and
    # not to dense attention's over the same tokens (the same weights with sparse attention off, one forward).
    layers = slice(0, 1) if use_nope else slice(None)
    if not use_nope:
        dense_model, _ = _bigram_pair(max_length=128)
        assert not dense_model.sparse_active
        seqs = np.zeros((2, lengths.max()), np.int32)
        for row, length in enumerate(lengths):
            seqs[row, :length] = (PROMPTS[row] + want[row].token_ids)[:length]
        _, _, dense = jax.jit(lambda m, x, c, n: m(x, c, n))(dense_model, jnp.asarray(seqs), dense_model.new_cache(2),
                                                             jnp.asarray(lengths, jnp.int32))
        for row, length in enumerate(lengths):
            got_k, want_k, dense_k = (np.asarray(c.k)[1:, row, :, :length] for c in (engine.cache, plain.cache, dense))
            np.testing.assert_allclose(got_k, want_k, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(dense_k[..., :20, :], want_k[..., :20, :], rtol=1e-4, atol=1e-5)  # dense there
            assert np.abs(dense_k[..., 48:, :] - want_k[..., 48:, :]).max() > 1e-2
    for name, kernel, stride in (("k1", 4, 2), ("k2", 16, 8)):
        for row, length in enumerate(lengths):
            n = (int(length) - kernel) // stride + 1
            np.testing.assert_allclose(np.asarray(getattr(engine.cache, name))[layers, row, :, :n],
                                       np.asarray(getattr(plain.cache, name))[layers, row, :, :n], rtol=1e-5, atol=1e-6)


def test_sparse_target_speculative_over_pages_equals_plain_sparse_greedy():
    """The speculative engine over a paged target cache (InfLLM-v2 over pages: trees verified in the rows'
    scratch regions against the paged prefix's compressed keys, accepted paths committed into pages and
    their compressed keys extended there) gives plain sparse greedy decoding's tokens on the contiguous
    cache."""
    from minicpm_jax.engine.paging import Paging

    model, draft = _sparse_pair(False, block_size=16)
    assert model.sparse_active and model.sparse.block_size == 16
    want, _ = Engine(model, batch_size=2, chunk_length=16).generate(PROMPTS, max_new_tokens=100)
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16),
                               batch_size=2, chunk_length=16, paging=Paging(num_pages=16, page_size=16))
    got, stats = engine.generate(PROMPTS, max_new_tokens=100)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats.spec_summary()["mean_accept_length"] > 1.5 and all(len(r.token_ids) == 100 for r in want)


def test_speculative_scheduler_shares_prefix_pages_with_its_draft():
    """A paged speculative engine in the server's scheduler with prefix caching on: the draft's pool shares
    the target's pages, so a prompt starting with an earlier one's 70 tokens shares the draft's pairs with
    the target's KV (3 whole pages: the 4th holds a pair of the token after it, computed again); every
    request gives plain greedy decoding's tokens, drafted trees are accepted, and the pool comes back whole."""
    from minicpm_jax.engine.paging import Paging
    from minicpm_jax.engine.scheduler import Request, Scheduler

    model, draft = _bigram_pair(max_length=128)
    rng = np.random.default_rng(5)
    system = [int(x) for x in rng.integers(1, VOCAB, 70)]
    prompts = [system + [int(x) for x in rng.integers(1, VOCAB, n)] for n in (3, 9, 1)]
    engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16), batch_size=2,
                               chunk_length=16, decode_block=2, paging=Paging(num_pages=40, page_size=16))
    sched = Scheduler(engine, max_queue=10)
    outputs = []
    for i, prompt in enumerate(prompts):
        req = Request(prompt, SamplingParams(), 30, [], lambda _: False, lambda *_: None)
        sched.submit(req)
        if i < 2:  # the first alone (its pages published), then two together
            while sched.active or sched.queued:
                sched.step()
        outputs.append(req)
    while sched.active or sched.queued:
        sched.step()
    assert [r.cached_tokens for r in outputs] == [0, 48, 48]
    # The oracle: each request alone on a contiguous speculative engine. The tokens are plain greedy
    # decoding's whatever the draft does; the draft shows in the rounds, which must be the same ones (a
    # draft reading pairs that are not its own drafts other trees and accepts less).
    alone = SpeculativeEngine(model, draft, spec=engine.spec, batch_size=1, chunk_length=16, decode_block=2)
    want_rounds = 0
    for req, prompt in zip(outputs, prompts):
        (want,), stats = alone.generate([prompt], max_new_tokens=30)
        assert req.output == want.token_ids
        want_rounds = want_rounds + np.asarray(stats.spec_accepted)
    got_rounds = np.asarray(engine.accept_counts())
    np.testing.assert_array_equal(got_rounds[1:], want_rounds[1:])  # rounds that emitted 1, 2, ... tokens
    assert (got_rounds * np.arange(len(got_rounds))).sum() > 1.5 * got_rounds[1:].sum()
    pages = engine.books.pages
    pages.check()
    assert pages.stats()["pages_used"] == 0


def test_draft_pool_holds_a_contiguous_drafts_pairs_after_a_prefix_hit():
    """The draft's K/V through the page table, for a prompt that shared 3 cached pages and then decoded
    into pages taken mid-generation, equal a contiguous speculative engine's draft cache for that prompt
    alone, position for position (this bigram draft hardly attends, so its tokens and rounds would not
    show a wrong pair)."""
    _check_draft_pool_after_a_prefix_hit("xla")


@pytest.mark.gpu
def test_gpu_draft_pool_holds_a_contiguous_drafts_pairs_after_a_prefix_hit():
    """The same with the Pallas kernels on the GPU (paged tree attention with the draft's window)."""
    _check_draft_pool_after_a_prefix_hit("pallas")


def _check_draft_pool_after_a_prefix_hit(attention_impl: str):
    from minicpm_jax.engine.paging import Paging

    model, draft = _bigram_pair(max_length=128, attention_impl=attention_impl)
    rng = np.random.default_rng(6)
    system = [int(x) for x in rng.integers(1, VOCAB, 70)]
    first, second = system + [3, 4], system + [5, 6, 7, 8, 9]
    spec = SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16, window_size=40)  # the draft's window, too
    paged = SpeculativeEngine(model, draft, spec=spec, batch_size=1, chunk_length=16, decode_block=2,
                              paging=Paging(num_pages=24, page_size=16))
    paged.generate([first], max_new_tokens=20, reuse_prefix=True)
    (got,), _ = paged.generate([second], max_new_tokens=40, reuse_prefix=True)
    assert paged.page_stats()["prefix_hits"] == 48  # 4 whole pages cached, the last one computed again
    alone = SpeculativeEngine(model, draft, spec=spec, batch_size=1, chunk_length=16, decode_block=2)
    (want,), _ = alone.generate([second], max_new_tokens=40)
    assert got.token_ids == want.token_ids
    # The draft read every pair but those its last round left pending (the length counts them).
    n = int(np.asarray(paged.steps.dcache.lengths)[0] - np.asarray(paged.steps.rounds.pend_n)[0])
    assert n == int(np.asarray(alone.steps.dcache.lengths)[0] - np.asarray(alone.steps.rounds.pend_n)[0])
    assert n > len(second) + 16  # past the prompt's pages, into pages taken while decoding
    positions = jnp.arange(n, dtype=jnp.int32)[None, :]
    for name in ("k", "v"):
        pool = dataclasses.replace(paged.steps.dcache, k=getattr(paged.steps.dcache, name))
        got_kv = np.asarray(pool.keys_at(0, positions))[0]  # [n, KVH, D]
        want_kv = np.asarray(getattr(alone.steps.dcache, name))[0, 0, :, :n].transpose(1, 0, 2)
        np.testing.assert_allclose(got_kv, want_kv, rtol=1e-5, atol=1e-5)


def test_sparse_tree_deeper_than_the_exact_limit_is_refused():
    model, draft = _sparse_pair(False)
    with pytest.raises(MiniCPMError, match="spec_num_iter 7 is deeper"):
        SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=7, topk_per_iter=2, tree_size=16), batch_size=1)


def test_bad_spec_settings_are_rejected(pair):
    model, draft = pair
    for spec, msg in [(SpecConfig(tree_size=65), "tree_size"), (SpecConfig(num_iter=1, tree_size=12), "candidates"),
                      (SpecConfig(num_iter=9, topk_per_iter=10), "<= 64")]:
        with pytest.raises(MiniCPMError, match=msg):
            SpeculativeEngine(model, draft, spec=spec)


def test_draft_checkpoint_round_trip_and_errors(pair, eagle3_draft, tmp_path):
    model, draft = pair
    llama = EagleDraft(DraftSpec.for_target(model.config, "llama"), max_length=MAX_LEN, attention_impl="xla",
                       dtype=jnp.float32, rngs=nnx.Rngs(3))
    for name, d in (("eagle3", eagle3_draft), ("llama", llama), ("draft", draft)):
        save_draft(d, str(tmp_path / name))
        loaded = load_draft(str(tmp_path / name), model.config, max_length=MAX_LEN, attention_impl="xla",
                            dtype=jnp.float32)
        assert loaded.spec == d.spec
        for a, b in zip(jax.tree.leaves(nnx.state(d)), jax.tree.leaves(nnx.state(loaded))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    path = str(tmp_path / "draft")
    from safetensors.numpy import load_file as load_tensors
    assert "midlayer.hidden_norm.weight" in load_tensors(str(tmp_path / "eagle3" / "model.safetensors"))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["input_norm2.weight"]
    tensors["layers.0.mlp.down_proj.weight"] = tensors["layers.0.mlp.down_proj.weight"][:, :5]
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(MiniCPMError) as e:  # both problems in one error (listed in the checkpoint map's order)
        load_draft(path, model.config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32)
    assert "missing tensor input_norm2.weight (expected shape [64])" in str(e.value)
    assert "tensor layers.0.mlp.down_proj.weight has shape [64, 5], expected [64, 96]" in str(e.value)
    save_file({"model.eagle_layers.1.mlp.down_proj.weight": np.ones(4, np.float32), "model.fc.weight": np.ones((2, 2), np.float32)},
              f"{path}/model.safetensors")
    with pytest.raises(MiniCPMError, match="only one-layer drafts"):
        load_draft(path, model.config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32)
    e3 = load_tensors(str(tmp_path / "eagle3" / "model.safetensors"))
    e3["d2t"] = e3["d2t"] + 50
    save_file(e3, str(tmp_path / "eagle3" / "model.safetensors"))
    with pytest.raises(MiniCPMError, match="d2t maps draft ids outside"):
        load_draft(str(tmp_path / "eagle3"), model.config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32)
    with pytest.raises(MiniCPMError, match="does not exist"):
        load_draft(str(tmp_path / "nowhere"), model.config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32)


def test_frspec_files_written_by_torch_save_are_read_without_torch(tmp_path):
    torch = pytest.importorskip("torch")
    ids = [7, 3, 3, 9, 2, 7, 11]
    torch.save(ids, tmp_path / "freq_8.pt")
    torch.save(ids, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for f in ("freq_8.pt", "legacy.pt"):
        got = read_frspec(str(tmp_path / f), vocab_size=16)
        assert got.tolist() == [7, 3, 9, 2, 11]
    assert read_frspec(str(tmp_path), vocab_size=16, subset_size=8).tolist() == [7, 3, 9, 2, 11]
    np.save(tmp_path / "ours.npy", np.array([4, 1, 4]))
    assert read_frspec(str(tmp_path / "ours.npy"), vocab_size=16).tolist() == [4, 1]
    with pytest.raises(MiniCPMError, match="outside the vocabulary"):
        read_frspec(str(tmp_path / "freq_8.pt"), vocab_size=10)
    torch.save({"w": torch.zeros(2)}, tmp_path / "tensor.pt")
    with pytest.raises(MiniCPMError, match="not an FR-Spec index"):
        read_frspec(str(tmp_path / "tensor.pt"), vocab_size=16)
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(ModelConfig))  # a global: refused, not imported
    with pytest.raises(MiniCPMError, match="not an FR-Spec index"):
        read_frspec(str(tmp_path / "evil.pt"), vocab_size=16)


@pytest.mark.gpu
def test_greedy_speculative_with_pallas_kernels_on_gpu():
    cfg = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=VOCAB))
    model, draft = _bigram_pair()
    pallas_model = MiniCPMForCausalLM(cfg, max_length=MAX_LEN, attention_impl="pallas", dtype=jnp.float32,
                                      rngs=nnx.Rngs(0), sparse="off")
    pallas_model = nnx.merge(nnx.graphdef(pallas_model), nnx.state(model))
    pallas_draft = EagleDraft(draft.spec, max_length=MAX_LEN, attention_impl="pallas", dtype=jnp.float32, rngs=nnx.Rngs(0))
    pallas_draft = nnx.merge(nnx.graphdef(pallas_draft), nnx.state(draft))
    want, _ = Engine(model, batch_size=2, chunk_length=16).generate(PROMPTS, max_new_tokens=30)
    engine = SpeculativeEngine(pallas_model, pallas_draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16),
                               batch_size=2, chunk_length=16)
    out, stats = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in out] == [r.token_ids for r in want]
    assert stats.spec_summary()["mean_accept_length"] > 1.8


def test_convert_eagle_between_layouts_and_frspec_from_a_corpus(pair, tmp_path, tiny_ckpt):
    """CPM.cu layout -> vLLM layout (with the target's head) -> CPM.cu layout gives the same draft; the
    vLLM file loads directly too. frspec counts a corpus into freq_<V>.npy files that read_frspec reads."""
    from checkpoints_convert.__main__ import main as convert
    from safetensors.numpy import load_file as load_tensors
    from minicpm_jax.model.loading import load_model

    model = load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=MAX_LEN)
    draft = EagleDraft(DraftSpec.for_target(model.config), max_length=MAX_LEN, attention_impl="xla",
                       dtype=jnp.float32, rngs=nnx.Rngs(4))
    save_draft(draft, str(tmp_path / "cpmcu"))
    assert convert(["eagle", "--src", str(tmp_path / "cpmcu"), "--dst", str(tmp_path / "vllm"), "--layout", "vllm"]) == 2
    assert convert(["eagle", "--src", str(tmp_path / "cpmcu"), "--dst", str(tmp_path / "vllm"), "--layout", "vllm",
                    "--target", tiny_ckpt[0]]) == 0
    names = set(load_tensors(str(tmp_path / "vllm" / "model.safetensors")))
    assert {"model.fc.weight", "model.eagle_layers.0.mlp.down_proj.weight", "lm_head.weight",
            "model.embed_tokens.weight", "model.input_norm1.weight"} <= names
    assert convert(["eagle", "--src", str(tmp_path / "vllm"), "--dst", str(tmp_path / "back")]) == 0
    for path in ("vllm", "back"):
        loaded = load_draft(str(tmp_path / path), model.config, max_length=MAX_LEN, attention_impl="xla",
                            dtype=jnp.float32)
        for a, b in zip(jax.tree.leaves(nnx.state(draft)), jax.tree.leaves(nnx.state(loaded))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert convert(["eagle", "--src", str(tmp_path / "vllm"), "--dst", str(tmp_path / "back")]) == 2  # exists


@pytest.mark.smollm2
def test_frspec_index_from_a_corpus(smollm2_dir, tmp_path):
    from checkpoints_convert.__main__ import main as convert
    from minicpm_jax.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat\n\nthe end\n", encoding="utf-8")
    assert convert(["frspec", "--tokenizer", smollm2_dir, "--corpus", str(corpus), "--vocab_sizes", "4,50",
                    "--dst", str(tmp_path / "fr")]) == 0
    tok = load_tokenizer(smollm2_dir)
    ids4 = read_frspec(str(tmp_path / "fr"), vocab_size=len(tok), subset_size=4)
    assert ids4[0] == tok.encode(" the", add_special_tokens=False)[0] or tok.decode([ids4[0]]).strip() == "the"
    assert tok.eos_token_id in ids4.tolist() and len(ids4) == 4
    assert len(read_frspec(str(tmp_path / "fr" / "freq_50.npy"), vocab_size=len(tok))) == 50
    assert convert(["frspec", "--tokenizer", smollm2_dir, "--corpus", str(tmp_path / "none.txt"),
                    "--dst", str(tmp_path / "fr2")]) == 2


def test_int4_gptq_draft_equals_its_dequantized_dense_draft(pair, plain_greedy, tmp_path):
    """A GPTQ (group 32, symmetric) quantized draft — fc and every layer linear int4, as CPM.cu's
    quantized drafts — computes what the dense draft of its dequantized weights computes, and keeps the
    greedy output."""
    import dataclasses
    import json
    import shutil

    from safetensors.numpy import load_file as load_tensors, save_file
    from minicpm_jax.io.int4_formats import gptq_pack, rtn_quantize

    model, draft = pair
    save_draft(draft, str(tmp_path / "dense"))
    tensors = load_tensors(str(tmp_path / "dense" / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, value in tensors.items():
        if value.ndim == 2:  # a linear [out, in]
            w = rtn_quantize(np.ascontiguousarray(value.T), group_size=32)
            w = dataclasses.replace(w, scales=w.scales.astype(np.float16).astype(np.float32))  # as stored
            quantized.update({f"{name[: -len('.weight')]}.{k}": np.ascontiguousarray(v) for k, v in gptq_pack(w).items()})
            dequantized[name] = np.ascontiguousarray(w.dequantize().T)
        else:
            quantized[name] = dequantized[name] = value
    for sub, ts in (("int4", quantized), ("deq", dequantized)):
        (tmp_path / sub).mkdir()
        save_file(ts, str(tmp_path / sub / "model.safetensors"))
        shutil.copy(tmp_path / "dense" / "config.json", tmp_path / sub / "config.json")
    (tmp_path / "int4" / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "sym": True,
                                                                         "desc_act": False}))
    load = lambda sub: load_draft(str(tmp_path / sub), model.config, max_length=MAX_LEN,  # noqa: E731
                                  attention_impl="xla", dtype=jnp.float32)
    int4_draft, deq_draft = load("int4"), load("deq")
    assert int4_draft.quant is not None and int4_draft.quant.group_size == 32
    assert type(int4_draft.fc).__name__ == "Int4Linear" and type(int4_draft.mlp.down_proj).__name__ == "Int4Linear"
    rng = np.random.default_rng(0)
    emb = jnp.asarray(rng.standard_normal((1, 6, 64)), jnp.float32)
    feat = jnp.asarray(rng.standard_normal((1, 6, 64)), jnp.float32)
    args = (emb, feat, jnp.arange(6)[None], jnp.ones((1, 6), bool))
    h_int4, _ = int4_draft(*args, int4_draft.new_cache(1, 32))
    h_deq, _ = deq_draft(*args, deq_draft.new_cache(1, 32))
    np.testing.assert_allclose(np.asarray(h_int4), np.asarray(h_deq), rtol=1e-4, atol=1e-4)
    engine = SpeculativeEngine(model, int4_draft, spec=SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16),
                               batch_size=2, chunk_length=16)
    out, _ = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in out] == plain_greedy
    del quantized["layers.0.mlp.up_proj.scales"]
    save_file(quantized, str(tmp_path / "int4" / "model.safetensors"))
    with pytest.raises(MiniCPMError, match="missing tensor layers.0.mlp.up_proj.scales"):
        load("int4")
    (tmp_path / "int4" / "quantize_config.json").unlink()
    with pytest.raises(MiniCPMError, match="no quantization_config"):
        load("int4")
    with pytest.raises(MiniCPMError, match="dense drafts"):
        save_draft(int4_draft, str(tmp_path / "again"))


def test_spec_prefill_rows_equals_the_masked_chunk_over_every_row():
    """A prompt piece of some slots run over their target and draft cache rows alone (what a server does
    while other slots decode) gives what the chunk over every slot gives, the others masked: the same
    cache and draft-cache rows, logits and final features for the live slots, the others untouched. Both
    jitted, as the engine runs them (op by op they took four times as long on the CPU)."""
    from minicpm_jax.engine.speculative import rounds

    spec_prefill_chunk, spec_prefill_rows = (jax.jit(f, static_argnums=0, static_argnames="dgraph")
                                             for f in (rounds.spec_prefill_chunk, rounds.spec_prefill_rows))

    cfg = ModelConfig.from_dict(tiny_minicpm_config())
    model = MiniCPMForCausalLM(cfg, max_length=48, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(2))
    draft = EagleDraft(DraftSpec.for_target(cfg), max_length=48, attention_impl="xla", dtype=jnp.float32,
                       rngs=nnx.Rngs(3))
    (g, s), (dg, ds) = nnx.split(model), nnx.split(draft)
    rng = np.random.default_rng(0)
    b, c = 4, 8

    def filled(cache, lengths):  # earlier tokens' K/V: random, so every row differs
        return dataclasses.replace(cache, k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                                   v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32),
                                   lengths=jnp.asarray(lengths, jnp.int32))

    cache = filled(model.new_cache(b), [3, 5, 0, 7])
    dcache = filled(draft.new_cache(b, 48), [2, 4, 0, 6])
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, c)), jnp.int32)
    following = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, c)), jnp.int32)
    num_valid, draft_valid = jnp.asarray([0, 5, 0, 8], jnp.int32), jnp.asarray([0, 4, 0, 8], jnp.int32)
    last_feat = jnp.asarray(rng.normal(size=(b, draft.spec.feature_size)), jnp.float32)
    want = spec_prefill_chunk(g, s, ds, cache, dcache, tokens, following, num_valid, draft_valid,
                              jnp.zeros((b, cfg.vocab_size), jnp.float32), last_feat, dgraph=dg)
    idx = jnp.asarray([1, 3], jnp.int32)
    got = spec_prefill_rows(g, s, ds, cache, dcache, idx, tokens[idx], following[idx], num_valid[idx],
                            draft_valid[idx], last_feat, dgraph=dg)
    for w, o, before in ((want[0], got[0], cache), (want[1], got[1], dcache)):
        np.testing.assert_array_equal(o.lengths, w.lengths)
        for name in ("k", "v"):
            np.testing.assert_allclose(getattr(o, name)[:, 1::2], getattr(w, name)[:, 1::2], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(getattr(o, name)[:, 0::2], getattr(before, name)[:, 0::2])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)  # zeros for the masked slots
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[3][1], last_feat[1]) and np.abs(np.asarray(got[2][3])).sum() > 0
