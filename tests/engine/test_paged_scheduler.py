"""Serving over a paged KV cache: requests joining, sharing prompt prefixes, being preempted when the pool
runs out and resuming, give exactly the tokens they give alone on the contiguous cache; and after a fuzz
of random requests with cancels, host-side stops, several completions of one prompt and forced
preemptions, every request got its whole answer and every page is back in the pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.paging import Paging
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.engine.scheduler import Request, Scheduler
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from tests.helpers import tiny_minicpm_config

MAX_LEN = 96
PAGE = 16


@pytest.fixture(scope="module")
def model():
    config = ModelConfig.from_dict(tiny_minicpm_config())
    return MiniCPMForCausalLM(config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def solo(model):
    """The oracle: each request alone on the contiguous cache (memoised)."""
    engine = Engine(model, batch_size=1, chunk_length=16, decode_block=4)
    memo = {}

    def run(prompt, budget, sampling, stops=()):
        key = (tuple(prompt), budget, sampling, tuple(stops))
        if key not in memo:
            (res,), _ = engine.generate([list(prompt)], sampling=sampling, max_new_tokens=budget,
                                        stop_token_ids=list(stops))
            memo[key] = (res.token_ids, res.finish_reason)
        return memo[key]

    return run


def paged_scheduler(model, pages, slots=4, overlap=False, decode_block=2):
    engine = Engine(model, batch_size=slots, chunk_length=16, decode_block=decode_block,
                    paging=Paging(num_pages=pages, page_size=PAGE))
    return Scheduler(engine, max_queue=1000, overlap=overlap)


def _request(prompt, budget, sampling=SamplingParams(), stops=(), halt_after=None):
    record = {"blocks": []}

    def on_tokens(new):
        record["blocks"].append(list(new))
        return halt_after is not None and sum(map(len, record["blocks"])) >= halt_after

    def on_finish(reason, error):
        assert "finish" not in record, "finished twice"
        record["finish"], record["error"] = reason, error

    return Request(list(prompt), sampling, budget, list(stops), on_tokens, on_finish), record


def _drain(sched, limit=2000):
    steps = 0
    while sched.active or sched.queued:
        sched.step()
        steps += 1
        assert steps < limit, "the scheduler does not finish"
    return steps


def _pool_is_whole(sched):
    pages = sched.engine.books.pages
    pages.check()
    stats = pages.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]


@pytest.mark.parametrize("overlap", [False, True])
def test_paged_requests_with_preemption_match_solo(model, solo, overlap):
    """A pool of 12 pages (192 tokens) for 4 slots of up to 96: requests outgrow it mid-generation, the
    youngest are preempted and resume; every one gives its solo tokens."""
    rng = np.random.default_rng(0)
    specs = [(rng.integers(0, 97, n), b, SamplingParams(temperature=t, seed=s))
             for n, b, t, s in [(30, 40, 0.0, 0), (45, 30, 0.0, 0), (17, 50, 0.8, 3), (2, 60, 0.0, 0),
                                (33, 45, 1.0, 9), (60, 30, 0.0, 0), (9, 40, 0.7, 1)]]
    sched = paged_scheduler(model, pages=12, overlap=overlap)
    reqs = [_request(p, b, s) for p, b, s in specs]
    for req, _ in reqs:
        sched.submit(req)
    _drain(sched)
    assert sched.preempted > 0, "the pool was meant to run out"
    for (req, rec), (p, b, s) in zip(reqs, specs):
        ids, finish = solo(p, b, s)
        assert rec["error"] is None and (req.output, rec["finish"]) == (ids, finish)
        assert sum(rec["blocks"], []) == ids  # delivered once each, in order, across preemptions
    _pool_is_whole(sched)


def test_sparse_requests_sharing_a_prefix_through_preemption_match_solo():
    """InfLLM-v2 over pages in the server's scheduler: requests past dense_len sharing a 53-token system
    prompt (its 3 full pages and their compressed keys computed once), preempted when the pool runs out,
    give their tokens alone on the contiguous cache."""
    sp = SparseConfig(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=PAGE, window_size=2 * PAGE, topk=3,
                      use_nope=False, dense_len=48)
    sparse = MiniCPMForCausalLM(ModelConfig.from_dict(tiny_minicpm_config()), max_length=MAX_LEN, attention_impl="xla",
                                dtype=jnp.float32, rngs=nnx.Rngs(6), sparse=sp)
    rng = np.random.default_rng(4)
    system = list(rng.integers(0, 97, 3 * PAGE + 5))
    prompts = [system + list(rng.integers(0, 97, n)) for n in (4, 11, 2, 7, 20)]
    sched = paged_scheduler(sparse, pages=12)
    reqs = [_request(p, 30) for p in prompts]
    for req, _ in reqs:
        sched.submit(req)
    _drain(sched)
    assert sched.preempted > 0 and sched.engine.page_stats()["prefix_hits"] >= 3 * PAGE
    solo = Engine(sparse, batch_size=1, chunk_length=16, decode_block=4)
    for (req, rec), p in zip(reqs, prompts):
        (want,), _ = solo.generate([p], max_new_tokens=30)
        assert rec["error"] is None and req.output == want.token_ids
    _pool_is_whole(sched)


def test_prefix_hit_gives_the_tokens_of_a_miss(model, solo):
    rng = np.random.default_rng(1)
    system = list(rng.integers(0, 97, 3 * PAGE + 5))
    first, second = system + [4, 5, 6], system + [7, 8]
    sched = paged_scheduler(model, pages=40)
    a, rec_a = _request(first, 12)
    sched.submit(a)
    _drain(sched)
    b, rec_b = _request(second, 12)
    sched.submit(b)
    _drain(sched)
    assert a.cached_tokens == 0 and b.cached_tokens == 3 * PAGE
    assert b.output == solo(second, 12, SamplingParams())[0] and a.output == solo(first, 12, SamplingParams())[0]
    stats = sched.engine.page_stats()
    assert stats["prefix_hits"] == 3 * PAGE and 0 < stats["hit_rate"] < 1
    _pool_is_whole(sched)


def test_completions_of_one_prompt_share_its_pages(model, solo):
    """Three requests with one prompt submitted at once: one computes the shared pages, the others wait
    for them and prefill only the last page."""
    rng = np.random.default_rng(2)
    prompt = list(rng.integers(0, 97, 2 * PAGE + 3))
    sched = paged_scheduler(model, pages=40)
    reqs = [_request(prompt, 8, SamplingParams(temperature=0.9, seed=i)) for i in range(3)]
    for req, _ in reqs:
        sched.submit(req)
    _drain(sched)
    assert sorted(r.cached_tokens for r, _ in reqs) == [0, 2 * PAGE, 2 * PAGE]
    for i, (req, _) in enumerate(reqs):
        assert req.output == solo(prompt, 8, SamplingParams(temperature=0.9, seed=i))[0]
    _pool_is_whole(sched)


def test_paged_scheduler_refuses_prompts_larger_than_the_pool(model):
    sched = paged_scheduler(model, pages=2)
    with pytest.raises(MiniCPMError, match="KV pool holds 32"):
        sched.submit(_request(list(range(40)), 4)[0])


def test_fuzz_requests_cancels_stops_siblings_and_preemptions(model, solo):
    """200 random requests over a pool a third of the slots' worth: arrivals during the run, prompts on
    three shared prefixes, groups of completions of one prompt, cancels (queued or running), host-side
    stops and stop ids. Every request ends once with its solo answer (or a prefix of it, when cancelled or
    stopped by its consumer), and every page is back in the pool."""
    rng = np.random.default_rng(7)
    bases = [list(rng.integers(0, 97, n)) for n in (2 * PAGE, PAGE + 7, 0)]
    sched = paged_scheduler(model, pages=10, slots=4, overlap=True)
    pending = []
    while len(pending) < 200:
        prompt = bases[rng.integers(3)] + list(rng.integers(0, 97, rng.integers(1, 20)))
        budget = int(rng.integers(1, 26))
        stops = [int(rng.integers(0, 97))] if rng.random() < 0.3 else []
        for i in range(int(rng.choice([1, 1, 1, 3]))):  # sometimes n = 3 completions of one prompt
            sampling = SamplingParams(temperature=0.8, seed=int(rng.integers(1000))) if rng.random() < 0.5 \
                else SamplingParams()
            halt = int(rng.integers(1, budget + 1)) if rng.random() < 0.1 else None
            req, rec = _request(prompt, budget, sampling, stops, halt_after=halt)
            cancel_at = int(rng.integers(0, 8)) if rng.random() < 0.1 else None
            pending.append((req, rec, prompt, budget, sampling, stops, halt, cancel_at))
    live, submitted, step = list(pending), [], 0
    while live or sched.active or sched.queued:
        for _ in range(int(rng.integers(0, 4))):
            if live:
                sched.submit(live[0][0])
                submitted.append((step, live.pop(0)))
        for at, item in submitted:
            if item[7] is not None and step - at == item[7]:
                sched.cancel(item[0])
        sched.step()
        step += 1
        assert step < 5000, "the scheduler does not finish"
    assert sched.preempted > 0 and sched.completed == 200
    for _, (req, rec, prompt, budget, sampling, stops, halt, cancel_at) in submitted:
        ids, finish = solo(prompt, budget, sampling, stops)
        assert rec["error"] is None and sum(rec["blocks"], []) == req.output
        if rec["finish"] == "cancelled":
            assert cancel_at is not None and req.output == ids[: len(req.output)]
        elif halt is not None and (req.output, rec["finish"]) != (ids, finish):  # stopped by its consumer
            assert rec["finish"] == "stop" and len(req.output) >= halt and req.output == ids[: len(req.output)]
        else:
            assert (req.output, rec["finish"]) == (ids, finish)
    _pool_is_whole(sched)


def test_decode_rows_go_to_the_device_once_while_they_stay_the_same(model):
    """A paged decode over the same rows sends nothing to the device (the rows stay there): on a GPU a
    host array passed to the step waited for the queued steps before it, so the host could not work ahead.
    New rows are sent again."""
    import jax

    engine = Engine(model, batch_size=8, chunk_length=16, decode_block=1, paging=Paging(num_pages=40, page_size=PAGE))
    engine.prefill_chunk([[5, 6, 7], [8, 9], [], [], [], [], [], []], 16)
    ds = engine.decode_state([SamplingParams()] * 2, [30, 30], [[], []])
    engine._reserve({0: 3 * PAGE, 1: 3 * PAGE})  # pages for every step below: no page table change
    ds, first = engine.decode(ds, rows=[0, 1])
    with jax.transfer_guard_host_to_device("disallow_explicit"):  # no transfer at all, explicit or not
        ds, second = engine.decode(ds, rows=[0, 1])
        with pytest.raises(Exception, match="host-to-device"):
            engine.decode(ds, rows=[1])  # one row: padded to [1], not to [0, 1, 2, 3] as the two were
    assert (np.asarray(first)[:2] >= 0).all() and (np.asarray(second)[:2] >= 0).all()
