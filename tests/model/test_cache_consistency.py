"""Static cache consistency: prefill+decode, chunking and batching all compute the same function."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.model.loading import load_model
from tests import helpers

MAX_LEN = 128


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=MAX_LEN)


def _full_logits(model, ids):
    cache = model.new_cache(1, MAX_LEN)
    logits, _, _ = model(jnp.asarray([ids], jnp.int32), cache)
    return np.asarray(logits[0])


def test_prefill_then_decode_equals_full_forward(model):
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 40)
    full = _full_logits(model, ids)
    cache = model.new_cache(1, MAX_LEN)
    step = jax.jit(lambda m, c, x: m(x, c))
    logits, _, cache = step(model, cache, jnp.asarray([ids[:25]], jnp.int32))
    got = [np.asarray(logits[0])]
    for t in ids[25:]:
        logits, _, cache = step(model, cache, jnp.asarray([[t]], jnp.int32))
        got.append(np.asarray(logits[0]))
    assert int(cache.lengths[0]) == 40
    assert helpers.rel_err(np.concatenate(got), full) < 1e-5


def test_chunked_prefill_equals_unchunked(model):
    ids = list(np.random.default_rng(1).integers(0, model.config.vocab_size, 53))
    whole = Engine(model, chunk_length=64)
    chunked = Engine(model, chunk_length=16)  # 4 chunks, the last one padded
    logits_whole = whole.prefill([ids])
    logits_chunked = chunked.prefill([ids])
    assert helpers.rel_err(logits_chunked[0], logits_whole[0]) < 1e-5
    assert helpers.rel_err(logits_whole[0], _full_logits(model, ids)[-1]) < 1e-5
    # Padded positions were dropped: only 53 slots are valid and the row holds the right keys.
    assert chunked.cache_lengths() == [53]
    assert helpers.rel_err(chunked.cache.k[:, 0, :, :53], whole.cache.k[:, 0, :, :53]) < 1e-5


def test_batch_of_three_equals_three_single_runs(model):
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, model.config.vocab_size, n)) for n in (7, 30, 19)]
    batched = Engine(model, batch_size=3, chunk_length=16, decode_block=4)
    results, _ = batched.generate(prompts, max_new_tokens=12)
    single = Engine(model, batch_size=1, chunk_length=16, decode_block=4)
    for prompt, res in zip(prompts, results):
        [alone], _ = single.generate([prompt], max_new_tokens=12)
        assert res.token_ids == alone.token_ids
    # And the batched prefill logits equal the single-row forward, row by row.
    batched.reset()
    logits = batched.prefill(prompts)
    for row, prompt in enumerate(prompts):
        assert helpers.rel_err(logits[row], _full_logits(model, prompt)[-1]) < 1e-5


def test_sampling_is_reproducible_and_seed_dependent(model):
    engine = Engine(model, batch_size=2, chunk_length=16, decode_block=5)
    prompt = list(range(3, 15))
    sp = SamplingParams(temperature=1.5, top_p=0.95, top_k=40, seed=7)
    a, _ = engine.generate([prompt], sampling=sp, max_new_tokens=20)
    b, _ = engine.generate([prompt], sampling=sp, max_new_tokens=20)
    c, _ = engine.generate([prompt], sampling=SamplingParams(temperature=1.5, top_p=0.95, top_k=40, seed=8), max_new_tokens=20)
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids
    # Batch-invariant: the same request beside another one draws the same tokens.
    d, _ = engine.generate([list(range(20, 30)), prompt], sampling=[SamplingParams(temperature=1.0, seed=1), sp], max_new_tokens=20)
    assert d[1].token_ids == a[0].token_ids
