"""Engine behaviour: stop conditions on device, streaming, multi-turn cache reuse, sampling filters, errors."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.sampling import SamplingParams, filter_top_k_top_p, sample
from minicpm_jax.engine.steps import Compiled
from minicpm_jax.engine.stops import DecodeState, live_block
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.loading import load_model

MAX_LEN = 64


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    model = load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=MAX_LEN)
    return Engine(model, batch_size=2, chunk_length=16, decode_block=4)


PROMPT = [3, 17, 40, 8, 9, 11, 60]


def test_max_new_tokens_gives_length(engine):
    [res], stats = engine.generate([PROMPT], max_new_tokens=9)
    assert len(res.token_ids) == 9 and res.finish_reason == "length"
    assert stats.prefill_tokens == len(PROMPT) and stats.decode_tokens == 8
    assert stats.prefill_time > 0 and stats.decode_time > 0


def test_stop_token_ends_generation_on_device(engine):
    [ref], _ = engine.generate([PROMPT], max_new_tokens=12)
    stop = ref.token_ids[5]
    first = ref.token_ids.index(stop)
    [res], _ = engine.generate([PROMPT], max_new_tokens=12, stop_token_ids=[stop])
    assert res.token_ids == ref.token_ids[: first + 1] and res.finish_reason == "stop"
    # Per-row stop lists: the other row is unaffected.
    res2, _ = engine.generate([PROMPT, PROMPT], max_new_tokens=12, stop_token_ids=[[stop], []])
    assert res2[0].token_ids == res.token_ids and res2[1].token_ids == ref.token_ids


def test_full_cache_ends_with_length(engine):
    prompt = list(np.arange(MAX_LEN - 5) % 90 + 3)
    [res], _ = engine.generate([prompt], max_new_tokens=100)
    # MAX_LEN - 5 prompt tokens + 5 more written; the token sampled from the last slot is returned too.
    assert res.finish_reason == "length" and len(res.token_ids) == 6
    assert engine.cache_lengths()[0] == MAX_LEN


def test_streaming_callback_sees_every_token_in_order(engine):
    blocks = []
    [res], _ = engine.generate([PROMPT], max_new_tokens=15, on_tokens=lambda new: blocks.append(new[0]))
    assert sum(blocks, []) == res.token_ids
    assert len(blocks) >= 4  # first token, then blocks of at most 4 (decode_block)
    assert all(len(b) <= 4 for b in blocks)


def test_callback_can_stop_a_row(engine):
    seen = []

    def on_tokens(new):
        seen.extend(new[0])
        return [0] if len(seen) >= 6 else None

    [res], _ = engine.generate([PROMPT], max_new_tokens=30, on_tokens=on_tokens)
    assert res.finish_reason == "stop" and 6 <= len(res.token_ids) < 30
    assert res.token_ids == seen


def test_callback_can_stop_a_row_at_its_first_token(engine):
    [res], _ = engine.generate([PROMPT], max_new_tokens=30, on_tokens=lambda new: [0])
    assert len(res.token_ids) == 1 and res.finish_reason == "stop"
    assert engine.cache_lengths()[0] == len(PROMPT)


def test_multi_turn_prefix_reuse_equals_fresh_run(engine):
    turn2 = [21, 22, 23]
    [a], _ = engine.generate([PROMPT], max_new_tokens=6)
    conversation = PROMPT + a.token_ids + turn2
    [b], stats = engine.generate([conversation], max_new_tokens=6, reuse_prefix=True)
    # Only the last sampled token (never cached) and the new turn are prefilled.
    assert stats.prefill_tokens == 1 + len(turn2)
    assert engine.cache_lengths()[0] == len(conversation) + 5
    [fresh], stats = engine.generate([conversation], max_new_tokens=6)
    assert stats.prefill_tokens == len(conversation)
    assert b.token_ids == fresh.token_ids
    # A prompt that diverges early rolls the cache back to the common prefix.
    [c], stats = engine.generate([PROMPT[:3] + [50, 51]], max_new_tokens=4, reuse_prefix=True)
    assert stats.prefill_tokens == 2
    [c_fresh], _ = engine.generate([PROMPT[:3] + [50, 51]], max_new_tokens=4)
    assert c.token_ids == c_fresh.token_ids
    # The same prompt again still runs its last token (logits are needed).
    [d], stats = engine.generate([PROMPT[:3] + [50, 51]], max_new_tokens=4, reuse_prefix=True)
    assert stats.prefill_tokens == 1
    assert d.token_ids == c_fresh.token_ids


def test_bf16_batch_runs_on_cpu_and_rows_are_batch_invariant(tiny_ckpt):
    """A bf16 model with two rows runs on the CPU (XLA's CPU runtime once refused the references' batched
    bf16 dots) and each row generates its solo tokens."""
    model = load_model(tiny_ckpt[0], dtype=jnp.bfloat16, max_length=MAX_LEN, attention_impl="xla")
    batch = Engine(model, batch_size=2, chunk_length=16, decode_block=4)
    prompts = [PROMPT, PROMPT[:4]]
    both, _ = batch.generate(prompts, max_new_tokens=8)
    for i, prompt in enumerate(prompts):
        [alone], _ = batch.generate([prompt], max_new_tokens=8)
        assert both[i].token_ids == alone.token_ids


def test_reset_recovers_from_a_donated_cache(engine):
    """A step interrupted between launch and return (Ctrl-C in a chat) can leave the engine holding donated
    buffers; reset() then starts from a fresh cache and generation gives the same tokens."""
    [ref], _ = engine.generate([PROMPT], max_new_tokens=6)
    for leaf in jax.tree.leaves(engine.cache):
        leaf.delete()
    engine.reset()
    [again], _ = engine.generate([PROMPT], max_new_tokens=6)
    assert again.token_ids == ref.token_ids


def test_prefill_callback_can_abort_between_chunks(engine):
    """The chat's Ctrl-C raises from on_prefill between chunks: the exception reaches the caller after
    the first chunk, and the engine stays consistent without a reset: a reuse_prefix call gives the
    uninterrupted tokens although the aborted prompt overwrote part of the cached one."""
    prompt = list(np.arange(40) % 90 + 3)  # three 16-token chunks
    [ref], _ = engine.generate([prompt], max_new_tokens=5)
    other = list(np.arange(40) % 70 + 5)
    calls = []

    def abort(done, total):
        calls.append(done)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate([other], max_new_tokens=5, reuse_prefix=True, on_prefill=abort)
    assert calls == [16]
    [again], _ = engine.generate([prompt], max_new_tokens=5, reuse_prefix=True)
    assert again.token_ids == ref.token_ids


def test_prompt_longer_than_max_length_is_rejected(engine):
    with pytest.raises(MiniCPMError, match="max_length is 64"):
        engine.generate([list(range(3, 3 + MAX_LEN))])
    with pytest.raises(MiniCPMError, match="empty prompt"):
        engine.generate([[]])
    with pytest.raises(MiniCPMError, match="outside the vocabulary"):
        engine.generate([[10_000]])
    with pytest.raises(MiniCPMError, match="1..2 prompts"):
        engine.generate([PROMPT] * 3)


@pytest.mark.parametrize("kw, msg", [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                                     ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(MiniCPMError, match=msg):
        SamplingParams(**kw)


def test_top_k_top_p_filter_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32) * 3
    top_k = np.array([0, 5, 0, 10], np.int32)
    top_p = np.array([0.5, 1.0, 0.9, 0.3], np.float32)
    got = np.asarray(filter_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for row in range(4):
        order = np.argsort(-logits[row])
        k = top_k[row] or 50
        kept = order[:k]
        p = np.exp(logits[row, kept] - logits[row, kept].max())
        p /= p.sum()
        n = int(np.searchsorted(np.cumsum(p), top_p[row]) + 1)  # smallest prefix with mass >= top_p
        expect = set(kept[: min(n, k)].tolist())
        assert set(np.flatnonzero(np.isfinite(got[row])).tolist()) == expect


def test_sampler_distribution_and_greedy():
    logits = jnp.log(jnp.asarray([[0.1, 0.6, 0.3]] * 2, jnp.float32))
    keys = jnp.stack([jax.random.PRNGKey(0)] * 2)
    draw = jax.jit(jax.vmap(lambda step: sample(logits, keys, jnp.full((2,), step, jnp.int32), jnp.asarray([1.0, 0.0]),
                                                 jnp.zeros(2, jnp.int32), jnp.ones(2))))
    draws = np.asarray(draw(jnp.arange(2000)))
    assert (draws[:, 1] == 1).all()  # temperature 0 row is greedy
    freq = np.bincount(draws[:, 0], minlength=3) / 2000
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.3], atol=0.04)


def test_static_sampling_kinds_draw_what_auto_draws():
    """Each static path (the engine compiles the one its requests need) equals the on-device choice."""
    from minicpm_jax.engine.sampling import sampling_kind

    assert sampling_kind([SamplingParams(), SamplingParams()]) == "greedy"
    assert sampling_kind([SamplingParams(), SamplingParams(temperature=0.5)]) == "temperature"
    assert sampling_kind([SamplingParams(top_k=5), SamplingParams(temperature=0.5, top_p=0.9)]) == "filtered"
    assert sampling_kind([SamplingParams(top_k=5)]) == "greedy"  # filters without temperature do nothing
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 50)) * 3
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(4)])
    steps = jnp.arange(4, dtype=jnp.int32)
    rows = {
        "greedy": ([0.0] * 4, [0] * 4, [1.0] * 4),
        "temperature": ([0.0, 0.7, 1.0, 2.0], [0] * 4, [1.0] * 4),
        "filtered": ([0.0, 0.7, 1.0, 2.0], [0, 3, 0, 10], [1.0, 1.0, 0.8, 0.5]),
    }
    for kind, (t, k, p) in rows.items():
        args = (logits, keys, steps, jnp.asarray(t), jnp.asarray(k, jnp.int32), jnp.asarray(p))
        np.testing.assert_array_equal(np.asarray(sample(*args, kind)), np.asarray(sample(*args)))
    with pytest.raises(ValueError, match="sampling kind"):
        sample(*args, "nucleus")


def test_command_buffer_flag_is_added_once_and_never_overrides_the_user(monkeypatch):
    import os

    from minicpm_jax.cli.system import COMMAND_BUFFER_FLAG, enable_command_buffers

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert enable_command_buffers() is True
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + COMMAND_BUFFER_FLAG
    assert enable_command_buffers() is False
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert enable_command_buffers() is False and os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="


def test_nccl_all_reduce_flag_is_added_once_and_never_overrides_the_user(monkeypatch):
    import os

    from minicpm_jax.cli.system import NCCL_ALL_REDUCE_FLAG, use_nccl_all_reduce

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert use_nccl_all_reduce() is True
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + NCCL_ALL_REDUCE_FLAG
    assert use_nccl_all_reduce() is False
    mine = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
    monkeypatch.setenv("XLA_FLAGS", mine)
    assert use_nccl_all_reduce() is False and os.environ["XLA_FLAGS"] == mine


def test_seeds_take_all_64_bits():
    """row_key is threefry's seeding (jax.random.PRNGKey under x64) for every 64-bit seed: seeds that
    differ only above bit 32 sample differently (without x64, PRNGKey drops those bits)."""
    from minicpm_jax.engine.sampling import row_key

    seeds = [0, 7, 2**31 + 3, 2**32 - 1, 2**32, 2**40 + 9, 2**63 - 1]
    with jax.enable_x64(True):
        want = [np.asarray(jax.random.PRNGKey(s)) for s in seeds]
    for s, w in zip(seeds, want):
        np.testing.assert_array_equal(np.asarray(row_key(s)), w)
    np.testing.assert_array_equal(np.asarray(row_key(2**64 - 1)), [2**32 - 1, 2**32 - 1])
    logits = jnp.zeros((1, 1000), jnp.float32)
    one = jnp.ones(1)
    draws = [int(sample(logits, row_key(s)[None], jnp.zeros(1, jnp.int32), one, jnp.zeros(1, jnp.int32), one)[0])
             for s in (5, 2**32 + 5, 2**64 - 1)]
    assert len(set(draws)) == 3
    SamplingParams(seed=2**64 - 1)
    with pytest.raises(MiniCPMError, match="seed must be in"):
        SamplingParams(seed=2**64)


def test_decode_state_is_built_on_the_host_and_sent_in_one_put(engine):
    """A fresh decode state is one explicit transfer (implicit ones, a jnp.asarray per field or per row's
    key, are refused here): on a GPU, one small transfer per row made the host wait for the device's
    queue at every step that started requests."""
    from minicpm_jax.engine.sampling import row_key

    b = engine.batch_size
    with jax.transfer_guard_host_to_device("disallow"):
        ds = engine.decode_state([SamplingParams(temperature=0.5, top_k=7, seed=2**40 + 1)], [9], [[2, 3]], [4])
    np.testing.assert_array_equal(np.asarray(ds.done), np.arange(b) >= 1)
    np.testing.assert_array_equal(np.asarray(ds.keys[0]), row_key(2**40 + 1))
    assert ds.keys.shape == (b, 2) and ds.keys.dtype == jnp.uint32
    assert (int(ds.n_gen[0]), int(ds.max_new[0]), int(ds.top_k[0]), float(ds.temperature[0])) == (4, 9, 7, 0.5)
    assert list(np.asarray(ds.stop_ids[0][:3])) == [2, 3, -1] and isinstance(ds.tok, jax.Array)


def test_prefill_chunk_pieces_cache_what_a_whole_prefill_does(tiny_ckpt):
    """Engine.prefill_chunk (a server's interleaved prefill): a prompt fed as pieces, one slot alone (its
    cache rows taken out and put back) or two slots in one forward, caches the K/V, lengths and last logits
    a whole-prompt prefill gives, and never changes the other slots."""
    model = load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=MAX_LEN)
    rng = np.random.default_rng(1)
    a, b, other = (list(rng.integers(3, 90, n)) for n in (37, 21, 9))
    ref = Engine(model, batch_size=3, chunk_length=16)
    want_logits = np.asarray(ref.prefill([a, b, other]))
    eng = Engine(model, batch_size=3, chunk_length=16)
    eng.prefill([[], [], other])
    other_k = np.asarray(eng.cache.k[:, 2])
    logits = {}

    def feed(pieces: dict[int, list[int]], size: int):
        out = np.asarray(eng.prefill_chunk([pieces.get(i, []) for i in range(3)], size))
        for slot in pieces:
            logits[slot] = out[slot]

    feed({0: a}, 8)  # slot 0 alone: its rows only
    feed({0: a[8:]}, 8)
    feed({0: a[16:], 1: b}, 8)  # two slots: every row's forward, the third masked
    feed({0: a[24:], 1: b[8:]}, 8)
    feed({1: b[16:]}, 8)
    feed({0: a[32:]}, 8)
    assert eng.cache_lengths() == [37, 21, 9]
    assert [key for key in eng.steps.compiled.executables if key[0] == "prefill_rows"]  # one slot ran alone
    np.testing.assert_array_equal(np.asarray(eng.cache.k[:, 2]), other_k)  # untouched, bit for bit
    for slot, n in ((0, 37), (1, 21), (2, 9)):
        for buf, ref_buf in ((eng.cache.k, ref.cache.k), (eng.cache.v, ref.cache.v)):
            np.testing.assert_allclose(np.asarray(buf[:, slot, :, :n]), np.asarray(ref_buf[:, slot, :, :n]),
                                       rtol=1e-5, atol=1e-5)
    for slot in (0, 1):
        np.testing.assert_allclose(logits[slot], want_logits[slot], rtol=1e-4, atol=1e-4)
    with pytest.raises(MiniCPMError, match="chunk_length"):
        eng.prefill_chunk([a], 17)


def test_logprobs_come_from_the_logits_each_step_sampled_from(tiny_ckpt):
    """first_token / decode with logprobs: each token's log-probability and the 20 most likely tokens of its
    step equal log_softmax of the logits a fresh forward of the whole sequence gives at that position; the
    tokens are the ones the steps give without logprobs."""
    model = load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=MAX_LEN)
    eng = Engine(model, batch_size=2, chunk_length=16, decode_block=3)
    prompts = [PROMPT, [5, 6, 7, 8]]
    samplings = [SamplingParams(), SamplingParams(temperature=0.9, seed=4)]
    want, _ = eng.generate(prompts, sampling=samplings, max_new_tokens=7)
    eng.reset()
    ds = eng.decode_state(samplings, [7, 7], [[], []])
    ds, (lp, ids, top) = eng.first_token(ds, eng.prefill(prompts), ~ds.done, logprobs=20)
    tokens, lps = [np.asarray(ds.tok)[:, None]], [(np.asarray(lp)[:, None], np.asarray(ids)[:, None], np.asarray(top)[:, None])]
    while not bool(np.all(np.asarray(ds.done))):
        ds, block, (lp, ids, top) = eng.decode(ds, logprobs=20)
        tokens.append(np.asarray(block))
        lps.append((np.asarray(lp), np.asarray(ids), np.asarray(top)))
    tokens = np.concatenate(tokens, 1)
    lp, ids, top = (np.concatenate(x, 1) for x in zip(*lps))
    for row, (prompt, res) in enumerate(zip(prompts, want)):
        got = [int(t) for t in tokens[row] if t >= 0]
        assert got == res.token_ids
        seq = jnp.asarray([prompt + got[:-1]], jnp.int32)
        hidden, _ = model.forward(seq, model.new_cache(1))
        oracle = np.asarray(jax.nn.log_softmax(model.logits(hidden[0, len(prompt) - 1:]), axis=-1))
        steps = np.nonzero(tokens[row] >= 0)[0]
        np.testing.assert_allclose(lp[row, steps], oracle[np.arange(len(got)), got], rtol=1e-4, atol=1e-4)
        order = np.argsort(-oracle, axis=1)[:, :20]
        np.testing.assert_array_equal(ids[row, steps][:, :5], order[:, :5])  # ties aside, the top ids
        np.testing.assert_allclose(top[row, steps], np.take_along_axis(oracle, ids[row, steps], 1), rtol=1e-4, atol=1e-4)
        assert np.all(np.diff(top[row, steps], axis=1) <= 0)


@pytest.mark.parametrize("kind", ["plain", "eagle"])
def test_step_sets_satisfy_the_step_set_protocol(kind):
    """Both step sets offer every member of StepSet with its parameters (names, order, defaults): the
    engine and the scheduler drive either through that contract alone."""
    import inspect

    from minicpm_jax.engine.speculative.engine import EagleSteps
    from minicpm_jax.engine.step_set import StepSet
    from minicpm_jax.engine.steps import PlainSteps

    cls = PlainSteps if kind == "plain" else EagleSteps
    members = [n for n in dir(StepSet) if not n.startswith("_")] + list(StepSet.__annotations__)
    for name in set(members):
        assert hasattr(cls, name) or name in ("model", "tokens_per_block", "page_size", "reuse_margin"), \
            f"{cls.__name__} lacks {name}"  # (instance attributes, set by __init__)
        proto = getattr(StepSet, name, None)
        if callable(proto) and not isinstance(proto, property):
            want = [(p.name, p.default) for p in inspect.signature(proto).parameters.values()]
            got = [(p.name, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]
            assert got[: len(want)] == want and all(p[1] is not inspect.Parameter.empty for p in got[len(want):]), (
                f"{cls.__name__}.{name}{got} does not match StepSet.{name}{want}")


def test_one_step_blocks_give_the_looped_tokens_and_a_finished_block_changes_nothing(engine, tiny_ckpt):
    """decode_block 1 (the server's) runs its step without a loop (stops.live_block): same tokens as blocks
    of 4, stops and budgets included; a block over rows that are all done leaves the cache and the state
    as they were and emits nothing."""
    one = Engine(engine.model, batch_size=2, chunk_length=16, decode_block=1)
    [ref], _ = engine.generate([PROMPT], max_new_tokens=12)
    stop = ref.token_ids[6]
    want, _ = engine.generate([PROMPT, PROMPT[:4]], max_new_tokens=[12, 5], stop_token_ids=[[stop], []])
    got, _ = one.generate([PROMPT, PROMPT[:4]], max_new_tokens=[12, 5], stop_token_ids=[[stop], []])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == ["stop", "length"]
    ds = one.decode_state([SamplingParams()] * 2, [1, 1], [[], []])
    ds = jax.tree.map(lambda x: x, ds)
    ds.done = jnp.ones_like(ds.done)
    lengths, k = one.cache_lengths(), np.asarray(one.cache.k)
    after, tokens = one.decode(ds)
    assert (np.asarray(tokens) == -1).all() and one.cache_lengths() == lengths
    np.testing.assert_array_equal(np.asarray(one.cache.k), k)
    np.testing.assert_array_equal(np.asarray(after.n_gen), np.asarray(ds.n_gen))


def _rows_state(done) -> DecodeState:
    b = len(done)
    i32 = lambda v: jnp.full((b,), v, jnp.int32)  # noqa: E731
    return DecodeState(tok=i32(0), done=jnp.asarray(done), finish=i32(0), n_gen=i32(0), max_new=i32(99),
                       keys=jnp.zeros((b, 2), jnp.uint32), temperature=jnp.zeros((b,)), top_k=i32(0),
                       top_p=jnp.ones((b,)), stop_ids=jnp.full((b, 4), -1, jnp.int32))


@pytest.mark.parametrize("check_each", [False, True], ids=["block", "each"])
@pytest.mark.parametrize("iterations, done, finish_at, want_ran, want_done", [
    (6, [True, True], 0, (0, 0), [True, True]),        # every row done at the start: the block runs nothing
    (6, [True, False], 2, (6, 2), [True, True]),       # the live row finishes after 2: to the block's end or not
    (6, [False, False], 99, (6, 6), [False, False]),   # no row finishes
    (1, [True, True], 0, (1, 1), [True, True]),        # one step runs unchecked (the server's block)
])
def test_live_block_runs_while_a_row_is_live(iterations, done, finish_at, want_ran, want_done, check_each):
    """stops.live_block: a fixed trip count (no predicate a step for the host to read) behind one check, or
    (check_each, where a loop condition costs no host round trip) a while loop that stops the block when its
    last row finishes."""
    def body(c):
        i, ran, ds = c
        return i + 1, ran + 1, dataclasses.replace(ds, done=ds.done | (i + 1 >= finish_at))

    run = jax.jit(lambda ds: live_block(body, (jnp.int32(0), jnp.int32(0), ds), iterations, check_each))
    i, ran, ds = run(_rows_state(done))
    assert int(ran) == int(i) == want_ran[check_each]
    assert np.asarray(ds.done).tolist() == want_done


def test_blocks_check_each_step_where_loop_conditions_stay_on_the_device(monkeypatch):
    """Off the GPU, and on one GPU with WHILE command buffers (as run / the server set them), a block checks
    its rows before every step; on a GPU without them, or split over several, once at its start."""
    from minicpm_jax.cli.system import COMMAND_BUFFER_FLAG
    from minicpm_jax.engine import stops

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert stops.loop_conditions_on_device() and stops.command_buffer_types() == set()  # this CPU
    monkeypatch.setattr(stops.jax, "default_backend", lambda: "gpu")
    assert not stops.loop_conditions_on_device()
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x " + COMMAND_BUFFER_FLAG)
    assert stops.loop_conditions_on_device() and not stops.loop_conditions_on_device(devices=2)
    monkeypatch.setenv("XLA_FLAGS", COMMAND_BUFFER_FLAG + " --xla_gpu_enable_command_buffer=+conditional,-WHILE")
    assert stops.command_buffer_types() == {"CONDITIONAL"} and not stops.loop_conditions_on_device()


def test_compiled_with_options_recompiles_only_the_named_programs():
    """A benchmark's trace recompiles the decode program with other XLA options: the named programs compile
    again under them (same results), the others' executables are the very same objects, and the original
    set is untouched."""
    base = Compiled({"f": jax.jit(lambda x: x + 1), "g": jax.jit(lambda x: x * 2)})
    x = jnp.arange(4.0)
    base("f", None, x), base("g", None, x)
    other = base.with_options({"xla_gpu_enable_command_buffer": ""}, {"f"})
    assert other.compiler_options == {"xla_gpu_enable_command_buffer": ""} and base.compiler_options is None
    assert [k[0] for k in other.executables] == ["g"] and other.executables[("g", None, ())] is base.executables[
        ("g", None, ())]
    np.testing.assert_array_equal(other("f", None, x), x + 1)
    assert other.executables[("f", None, ())] is not base.executables[("f", None, ())] and len(base.executables) == 2


def test_few_row_programs_compile_with_the_exhaustive_gemm_search_on_gpus_only(engine):
    """A few-row program takes FEW_ROW_OPTIONS on a GPU, under any options a trace adds; prefill and the CPU keep
    the given options; an XLA that knows the option compiles with it (this CPU's, asked as a GPU). The plain
    engine's few-row programs are its two decode programs."""
    from minicpm_jax.engine.steps import FEW_ROW_OPTIONS

    base = Compiled({"decode": jax.jit(lambda x: x + 1), "prefill": jax.jit(lambda x: x * 2)},
                    few_rows=frozenset({"decode"}))
    assert FEW_ROW_OPTIONS == {"xla_gpu_exhaustive_tiling_search": True}
    assert base.options("decode", "gpu") == FEW_ROW_OPTIONS and base.options("decode", "cpu") is None
    assert base.options("prefill", "gpu") is None
    traced = base.with_options({"xla_gpu_enable_command_buffer": ""}, {"decode"})
    assert traced.options("decode", "gpu") == {**FEW_ROW_OPTIONS, "xla_gpu_enable_command_buffer": ""}
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(jax.jit(lambda x: x + 1).lower(x).compile(base.options("decode", "gpu"))(x), x + 1)
    assert engine.steps.compiled.few_rows == {"decode", "decode_rows"}
