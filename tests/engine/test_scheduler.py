"""Continuous batching: requests joining a busy batch at different times give exactly the tokens they
give alone; stops, cancellation and the queue limit free and guard the slots."""

from __future__ import annotations

import collections
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.engine.scheduler import Draining, QueueFull, Request, Scheduler
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from tests.helpers import tiny_minicpm_config


@pytest.fixture(scope="module")
def tiny_model():
    config = ModelConfig.from_dict(tiny_minicpm_config())
    return MiniCPMForCausalLM(config, max_length=96, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(5))


def _request(prompt, budget, sampling=SamplingParams(), stops=(), halt_after=None, record=None):
    record = record if record is not None else {}

    def on_tokens(new):
        record.setdefault("blocks", []).append(list(new))
        return halt_after is not None and sum(map(len, record["blocks"])) >= halt_after

    def on_finish(reason, error):
        record["finish"], record["error"] = reason, error

    return Request(list(prompt), sampling, budget, list(stops), on_tokens, on_finish), record


@pytest.mark.parametrize("overlap", [False, True])
def test_joining_requests_match_solo_generation(tiny_model, overlap):
    rng = np.random.default_rng(0)
    vocab = tiny_model.config.vocab_size
    specs = [(rng.integers(0, vocab, n), b, SamplingParams(temperature=t, seed=s))
             for n, b, t, s in [(5, 12, 0.0, 0), (40, 7, 0.0, 0), (17, 20, 0.8, 3), (2, 9, 0.0, 0),
                                (33, 15, 1.0, 9), (9, 3, 0.0, 0), (70, 10, 0.0, 0)]]
    solo = Engine(tiny_model, batch_size=1, chunk_length=16, decode_block=4)
    expected = []
    for prompt, budget, sampling in specs:
        (res,), _ = solo.generate([list(prompt)], sampling=sampling, max_new_tokens=budget, stop_token_ids=[7])
        expected.append((res.token_ids, res.finish_reason))

    sched = Scheduler(Engine(tiny_model, batch_size=3, chunk_length=16, decode_block=4), max_queue=16,
                      overlap=overlap)
    reqs = [_request(p, b, s, stops=[7]) for p, b, s in specs]
    # Requests arrive while others are running: two now, the rest one per scheduler step.
    for req, _ in reqs[:2]:
        sched.submit(req)
    pending = list(reqs[2:])
    steps = 0
    while pending or sched.active or sched.queued:
        sched.step()
        steps += 1
        if pending:
            sched.submit(pending.pop(0)[0])
        assert steps < 200
    for (req, rec), (ids, finish) in zip(reqs, expected):
        assert req.output == ids and rec["finish"] == finish and rec["error"] is None
        assert sum(rec["blocks"], []) == ids
    assert sched.completed == len(specs) and sched.active == 0
    assert sched.finished == collections.Counter(f for _, f in expected)


def test_host_stop_cancel_and_queue_limit(tiny_model):
    sched = Scheduler(Engine(tiny_model, batch_size=2, chunk_length=16, decode_block=4), max_queue=1)
    halted, halted_rec = _request([3, 4, 5], 40, halt_after=6)
    cancelled, cancelled_rec = _request([6, 7, 8], 40)
    sched.submit(halted)
    with pytest.raises(QueueFull):
        sched.submit(_request([1], 5)[0])
    sched.step()  # admits `halted`
    sched.submit(cancelled)
    sched.step()
    sched.cancel(cancelled)
    for _ in range(30):
        sched.step()
        if not sched.active:
            break
    assert halted_rec["finish"] == "stop" and 6 <= len(halted.output) < 40
    assert cancelled_rec["finish"] == "cancelled" and len(cancelled.output) < 40
    assert sched.active == 0 and sched.slots == [None, None]
    assert sched.finished == collections.Counter({"stop": 1, "cancelled": 1})
    with pytest.raises(MiniCPMError, match="context"):
        sched.submit(_request(list(range(96)), 5)[0])


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_thread_serves_and_stops(tiny_model, overlap):
    sched = Scheduler(Engine(tiny_model, batch_size=2, chunk_length=16, decode_block=4), max_queue=8, overlap=overlap)
    sched.start()
    finished, all_done = [], threading.Event()

    def on_finish(reason, error):
        finished.append(reason)
        if len(finished) == 4:
            all_done.set()

    for i in range(4):
        req, _ = _request([i + 1, 2, 3], 6)
        req.on_finish = on_finish
        sched.submit(req)
    assert all_done.wait(120)
    sched.stop()
    assert finished == ["length"] * 4
    with pytest.raises(MiniCPMError, match="shutting down"):
        sched.submit(_request([1, 2], 3)[0])


def test_drain_ends_the_queue_and_lets_running_rows_finish(tiny_model):
    """drain(): queued requests end as "shutdown" at once, submit raises Draining, running rows go on to
    their own end with their solo tokens; cancel_all() then ends whatever still runs as "shutdown"."""
    solo = Engine(tiny_model, batch_size=1, chunk_length=16, decode_block=4)
    (want,), _ = solo.generate([[3, 4, 5]], max_new_tokens=10)
    sched = Scheduler(Engine(tiny_model, batch_size=2, chunk_length=16, decode_block=4), max_queue=4)
    short, short_rec = _request([3, 4, 5], 10)
    long, long_rec = _request([6, 7, 8], 80)
    waiting, waiting_rec = _request([9, 10], 5)
    for req in (short, long, waiting):
        sched.submit(req)
    sched.step()  # admits short and long; waiting stays queued
    sched.drain()
    assert waiting_rec["finish"] == "shutdown" and not waiting.output and sched.queued == 0
    with pytest.raises(Draining):
        sched.submit(_request([1], 3)[0])
    while short_rec.get("finish") is None:
        sched.step()
    assert short_rec["finish"] == "length" and short.output == want.token_ids
    assert not sched.idle and long_rec.get("finish") is None
    sched.cancel_all()
    sched.step()
    assert long_rec["finish"] == "shutdown" and sched.idle and len(long.output) < 80
    assert sched.finished == collections.Counter({"length": 1, "shutdown": 2})


def test_a_long_prompt_is_prefilled_in_pieces_between_decode_steps(tiny_model):
    """A long prompt arriving while rows decode is read prefill_budget tokens a step, a decode block of the
    running rows after each piece (it used to be prefilled whole before they could go on); every request
    still gives its solo tokens, and a request that arrives is admitted at the next step."""
    rng = np.random.default_rng(3)
    vocab = tiny_model.config.vocab_size
    running = [list(rng.integers(0, vocab, 6)), list(rng.integers(0, vocab, 11))]
    long_prompt = list(rng.integers(0, vocab, 70))
    late = list(rng.integers(0, vocab, 5))
    solo = Engine(tiny_model, batch_size=1, chunk_length=16, decode_block=2)
    want = [solo.generate([p], max_new_tokens=n)[0][0].token_ids for p, n in
            ((running[0], 40), (running[1], 40), (long_prompt, 5), (late, 3))]
    sched = Scheduler(Engine(tiny_model, batch_size=4, chunk_length=32, decode_block=2), prefill_budget=16)
    recs = [_request(p, 40) for p in running]
    for req, _ in recs:
        sched.submit(req)
    for _ in range(3):
        sched.step()
    long, long_rec = _request(long_prompt, 5)
    sched.submit(long)
    steps_to_first, tokens_meanwhile = 0, []
    while not long.output:
        before = [len(req.output) for req, _ in recs]
        sched.step()
        steps_to_first += 1
        tokens_meanwhile.append([len(req.output) - b for (req, _), b in zip(recs, before)])
    # ceil(70 / 16) = 5 pieces, one a step; both running rows got a decode block (2 tokens) every step.
    assert steps_to_first == 5, steps_to_first
    assert all(n == [2, 2] for n in tokens_meanwhile), tokens_meanwhile
    late_req, _ = _request(late, 3)
    sched.submit(late_req)
    sched.step()
    assert len(late_req.output) == 1  # admitted, prefilled and given its first token at the next step
    while sched.active:
        sched.step()
    assert [r.output for r, _ in recs] + [long.output, late_req.output] == want
    assert long_rec["finish"] == "length"
    # The step statistics (/health's "steps"): every prompt token read once, the 4 first tokens sampled
    # after prefill and the other 84 from blocks of 2: ceil(39 / 2) * 2 + 2 + 1 = 43 row-blocks, and one
    # more for each request, dispatched before the block that ended it was read (the device skips it).
    st = sched.stats
    assert st.prefill_tokens == 6 + 11 + 70 + 5 and st.prefill_steps >= 5 + 3
    assert st.decode_rows == 43 + 4 and st.decode_steps <= st.steps
    assert st.busy_s > st.device_wait_s > 0 and st.busy_s > st.dispatch_s > 0
    assert 0 < st.cpu_s <= st.busy_s * 1.01  # one thread runs at most the wall time (two clocks: a little slack)


def test_logprobs_arrive_with_their_tokens(tiny_model):
    """A request with logprobs gets one (logprob, top alternatives) entry per token before each on_tokens,
    the same alone as beside a request without them; greedy tokens are their step's most likely."""
    def run(batch, specs):
        sched = Scheduler(Engine(tiny_model, batch_size=batch, chunk_length=16, decode_block=3), prefill_budget=16)
        out = []
        for prompt, k in specs:
            req, rec = _request(prompt, 9)
            req.logprobs, entries = k, []
            req.on_logprobs = entries.extend
            sched.submit(req)
            out.append((req, entries))
        while sched.active or sched.queued:
            sched.step()
        return out

    (alone, alone_lp), = run(1, [([4, 8, 15, 16], 3)])
    (other, other_lp), (req, entries) = run(2, [([23, 42], None), ([4, 8, 15, 16], 3)])
    assert req.output == alone.output and len(entries) == len(req.output) == 9 and not other_lp
    for (lp, top), (lp1, top1), tok in zip(entries, alone_lp, req.output):
        assert len(top) == 3 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-6 and lp <= 0
        assert abs(lp - lp1) < 1e-5 and [i for i, _ in top] == [i for i, _ in top1]
        assert top[0][1] >= top[1][1] >= top[2][1]
    with pytest.raises(MiniCPMError, match="logprobs"):
        bad, _ = _request([1, 2], 3)
        bad.logprobs = 21
        Scheduler(Engine(tiny_model, batch_size=1, chunk_length=16)).submit(bad)


def _bigram_pair(vocab=24, max_length=96):
    """A target whose next token mostly follows the current one and an EAGLE draft that predicts that
    bigram (as tests/engine/test_speculative.py builds it), so speculative rounds often emit several tokens."""
    from minicpm_jax.config import DraftSpec
    from minicpm_jax.model.draft import EagleDraft

    cfg = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=vocab))
    model = MiniCPMForCausalLM(cfg, max_length=max_length, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(0))
    gd, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        name = ".".join(map(str, path))
        var.set_value(var[...] * (60.0 if "embed_tokens" in name or "lm_head" in name else 3.0 if "layers" in name else 1.0))
    model = nnx.merge(gd, nnx.from_flat_state(flat))
    draft = EagleDraft(DraftSpec.for_target(cfg), max_length=max_length, attention_impl="xla", dtype=jnp.float32,
                       rngs=nnx.Rngs(1))
    h = cfg.hidden_size
    draft.fc.kernel.set_value(jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], axis=0) * 4.0)
    for lin in (draft.self_attn.o_proj, draft.mlp.down_proj):
        lin.kernel.set_value(lin.kernel[...] * 0.05)
    return model, draft


def test_speculative_rounds_with_continuous_batching_give_plain_greedy_tokens():
    """A speculative engine behind the scheduler: requests joining at different times, one prompt read in
    pieces (over their own rows) while others run speculative rounds, give exactly the plain greedy
    tokens; a round emits its accepted tokens together (blocks of several tokens), as many per round as
    alone."""
    from minicpm_jax.engine.speculative.engine import SpeculativeEngine
    from minicpm_jax.engine.speculative.rounds import SpecConfig

    model, draft = _bigram_pair()
    prompts = [[3, 7, 9, 11, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13], list(np.arange(40) % 20 + 2), [2, 3], [9, 1, 4]]
    budgets = [30, 25, 20, 12, 18]
    plain = Engine(model, batch_size=1, chunk_length=16)
    want = [plain.generate([p], max_new_tokens=n)[0][0].token_ids for p, n in zip(prompts, budgets)]
    tree = SpecConfig(num_iter=3, topk_per_iter=4, tree_size=10)
    solo = SpeculativeEngine(model, draft, spec=tree, chunk_length=16, decode_block=1)
    solo_counts = sum(np.asarray(solo.generate([p], max_new_tokens=n)[1].spec_accepted) for p, n in zip(prompts, budgets))
    spec = SpeculativeEngine(model, draft, spec=tree, batch_size=3, chunk_length=16, decode_block=1)
    assert not spec.has_logprobs
    sched = Scheduler(spec, prefill_budget=8)
    reqs = [_request(p, n) for p, n in zip(prompts, budgets)]
    for req, _ in reqs[:2]:
        sched.submit(req)
    pending, steps = reqs[2:], 0
    while pending or sched.active or sched.queued:
        sched.step()
        steps += 1
        if pending and steps % 3 == 0:
            sched.submit(pending.pop(0)[0])
        assert steps < 400
    assert [r.output for r, _ in reqs] == want
    blocks = [len(b) for _, rec in reqs for b in rec["blocks"]]
    assert max(blocks) > 1  # accepted drafts: several tokens a round
    # The draft saw each row's pairs as it does alone (its state per row: pending pairs of rows joining a
    # running batch, a reused slot's pairs forgotten), so every round accepted what it accepts alone.
    assert list(np.asarray(spec.accept_counts())) == list(solo_counts) and sched.accept_counts == list(solo_counts)
    # Prompt pieces ran over their own rows (target and draft caches), never over all three slots.
    assert {k[0] for k in spec.steps.compiled.executables if k[0].startswith("prefill")} == {"prefill_rows"}


def test_prefill_steps_run_only_the_precompiled_shapes_over_their_own_rows(tiny_model):
    """A server compiles every prefill shape before its first request (``compile_prefill``): prompts of
    any length arriving together then meet no new program (a compilation would stall every stream), each
    step reads at most ``max_rows`` prompts (the budget's and the scratch rows' limit), over those rows
    (padded to a power of two) and not every slot, and every request still gives its solo tokens."""
    rng = np.random.default_rng(11)
    vocab = tiny_model.config.vocab_size
    prompts = [list(rng.integers(0, vocab, n)) for n in (5, 40, 17, 2, 33, 9, 70, 3, 12, 26)]
    # Sampling paths: greedy, one top-k request, one temperature-only request.
    samplings = [SamplingParams()] * len(prompts)
    samplings[2], samplings[4] = SamplingParams(temperature=0.9, top_k=3, seed=4), SamplingParams(temperature=0.7, seed=5)
    solo = Engine(tiny_model, batch_size=1, chunk_length=16, decode_block=2)
    want = [solo.generate([p], sampling=sp, max_new_tokens=4)[0][0].token_ids for p, sp in zip(prompts, samplings)]

    one_scratch_row = Scheduler(Engine(tiny_model, batch_size=8, chunk_length=64), prefill_budget=64)
    assert one_scratch_row.max_rows(32) == 1 and one_scratch_row.prefill_shapes() == [(1, 32), (1, 64)]
    engine = Engine(tiny_model, batch_size=8, chunk_length=64, decode_block=2, scratch_rows=4)
    assert [engine.prefill_row_count(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    sched = Scheduler(engine, max_queue=16, prefill_budget=64)
    assert sched.max_rows(32) == 2 and sched.max_rows(64) == 1  # the budget, not the scratch, limits here
    assert sched.prefill_shapes() == [(1, 32), (1, 64), (2, 32)]
    sched.compile_prefill()
    programs = {k for k in engine.steps.compiled.executables if k[0].startswith("prefill")}
    assert {k[1] for k in programs} == {(1, 32), (2, 32), (1, 64)} and all(k[0] == "prefill_rows" for k in programs)

    # compile_decode: the first token and the decode block on both served sampling paths, with and without
    # log-probabilities; never "auto" (its on-device choice is a conditional that syncs the host on a GPU).
    # A server may ask for one path (--warm_up_sampling): the other is then left to its first request.
    sched.compile_decode(("temperature",))
    assert {dict(k[2])["sampling"] for k in engine.steps.compiled.executables if k[0] in ("first", "decode")} \
        == {"temperature"}
    with pytest.raises(MiniCPMError, match="served sampling paths"):
        sched.compile_decode(("greedy",))
    sched.compile_decode()
    compiled = set(engine.steps.compiled.executables)
    assert {(k[0], dict(k[2])["sampling"], dict(k[2]).get("logprobs", 0)) for k in compiled
            if k[0] in ("first", "decode")} == {(name, kind, lp) for name in ("first", "decode")
                                                for kind in ("temperature", "filtered") for lp in (0, 20)}

    recs = [_request(p, 4, sp) for p, sp in zip(prompts, samplings)]
    for req, _ in recs:
        sched.submit(req)
    steps = 0
    while sched.active or sched.queued:
        sched.step()
        steps += 1
        assert steps < 200
    assert set(engine.steps.compiled.executables) == compiled  # nothing compiled while serving
    assert [req.output for req, _ in recs] == want
    with pytest.raises(MiniCPMError, match="before the scheduler starts"):
        sched.submit(_request(prompts[0], 50)[0])
        sched.step()
        sched.compile_prefill()
