"""EAGLE draft training (``minicpm_jax.train``): the unrolled steps against the engine's own tree path, the
gradients against finite differences, a trained draft against a random one in the speculative engine,
greedy losslessness with it, resumption, data parallelism, and the data readers."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import SpeculativeEngine
from minicpm_jax.engine.speculative.rounds import SpecConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import TreeInputs
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.loading import load_draft, save_draft
from minicpm_jax.train.data import (Example, Sequences, batch_rows, frequent_ids, pack, read_examples,
                                    split_heldout)
from minicpm_jax.train.objective import Objective, draft_unroll, losses, target_pass
from minicpm_jax.train.trainer import DraftTrainer, TrainConfig, new_draft
from tests.helpers import tiny_minicpm_config

VOCAB = 32
MAX_LEN = 64
RESUME_CFG = TrainConfig(steps=6, batch_size=4, learning_rate=1e-3, warmup_steps=2, eval_every=3, save_every=0)


def _target(seed=0) -> MiniCPMForCausalLM:
    """A tiny target whose next token follows mostly from the current one (a sharp embedding → lm_head
    path), so its greedy text is learnable by a one-layer draft in a few hundred steps."""
    cfg = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=VOCAB))
    model = MiniCPMForCausalLM(cfg, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32,
                               rngs=nnx.Rngs(seed), sparse="off")
    gd, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        name = ".".join(map(str, path))
        var.set_value(var[...] * (40.0 if "embed_tokens" in name or "lm_head" in name else 2.0))
    return nnx.merge(gd, nnx.from_flat_state(flat))


def _draft(model, kind="llama", seed=1) -> EagleDraft:
    return EagleDraft(DraftSpec.for_target(model.config, kind), max_length=MAX_LEN, attention_impl="xla",
                      dtype=jnp.float32, rngs=nnx.Rngs(seed))


def _greedy_data(model, n=48, prompt_len=4, new=20, seed=0) -> Sequences:
    """Self-distillation on token ids: the target's greedy continuations of random prompts."""
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(3, VOCAB, prompt_len))) for _ in range(n)]
    engine = Engine(model, batch_size=16, chunk_length=16, decode_block=8)
    examples = []
    for i in range(0, n, 16):
        results, _ = engine.generate(prompts[i : i + 16], max_new_tokens=new)
        examples += [Example(p + r.token_ids, len(p) - 1) for p, r in zip(prompts[i : i + 16], results)]
    return pack(examples, 32)


@pytest.fixture(scope="module")
def trained():
    """(target, random draft, trained draft, data, first and last training loss)."""
    model = _target()
    data = _greedy_data(model)
    train, held = split_heldout(data, 0.125, 0)
    cfg = TrainConfig(steps=300, batch_size=8, learning_rate=3e-3, warmup_steps=20, eval_every=0, save_every=0)
    trainer = DraftTrainer(model, _draft(model), train, cfg, heldout=held)
    first, _ = trainer.loss_and_metrics(np.arange(8))
    summary = trainer.run(progress=False)
    last, _ = trainer.loss_and_metrics(np.arange(8))
    return model, _draft(model), trainer.draft(), data, first, last, summary


def test_unrolled_steps_see_what_a_draft_tree_node_sees():
    """Step k's output at index i equals the engine's path: the draft reads the pairs 0..i causally, then
    runs k tree steps on its own outputs, each node attending to the prefix and its own ancestors."""
    model = _target()
    draft = _draft(model, "minicpm")
    b, t, steps, i = 2, 8, 3, 3  # index 3: the prefix and the chain both matter; i + steps < t

    @jax.jit
    def unrolled(tokens):
        lengths = jnp.full((b,), t, jnp.int32)
        features = target_pass(model, tokens, lengths, ())[1]
        return draft_unroll(model, draft, tokens, lengths, features, steps), features

    @jax.jit
    def engine_path(tokens, features):
        cache = draft.new_cache(b, MAX_LEN)
        n = i + 1  # the pairs (x[j+1], f[j]), j <= i, appended as the draft's prefill does
        h, cache = draft(model.embed(tokens[:, 1 : n + 1]), features[:, :n], jnp.broadcast_to(jnp.arange(n), (b, n)),
                         jnp.ones((b, n), bool), cache)
        outs = [h[:, -1]]
        h = h[:, -1:]
        for k in range(1, steps):  # a chain of tree nodes, as expand_tree runs them
            mask = jnp.broadcast_to(jnp.arange(steps - 1)[None, None, :] <= k - 1, (b, 1, steps - 1))
            h, cache = draft(model.embed(tokens[:, i + 1 + k][:, None]), h, jnp.full((b, 1), i + k),
                             jnp.ones((b, 1), bool), cache, TreeInputs(cache.lengths, mask, k - 1), from_target=False)
            outs.append(h[:, 0])
        return outs

    tokens = jax.random.randint(jax.random.key(0), (b, t), 3, VOCAB)
    outs, features = unrolled(tokens)
    for k, want in enumerate(engine_path(tokens, features)):
        np.testing.assert_allclose(np.asarray(outs[k][:, i]), np.asarray(want), rtol=2e-5, atol=2e-5,
                                   err_msg=f"step {k}")


@pytest.mark.parametrize("kind, steps", [("minicpm", 1), ("eagle3", 2)])
def test_gradients_match_finite_differences(kind, steps):
    model = _target()
    draft = _draft(model, kind)
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 3, VOCAB)
    lengths, starts = jnp.asarray([10, 7], jnp.int32), jnp.asarray([0, 2], jnp.int32)
    objective = dataclasses.replace(Objective.for_kind(kind, steps), feature_noise=0.0)
    gd, params, rest = nnx.split(draft, nnx.Param, ...)

    def f(p):
        return losses(model, nnx.merge(gd, p, rest), tokens, lengths, starts, objective)[0]

    grads = jax.jit(jax.grad(f))(params)
    f = jax.jit(f)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    direction = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    along = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    eps = 1e-3
    shift = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, params, direction)  # noqa: E731
    numeric = (f(shift(1.0)) - f(shift(-1.0))) / (2 * eps)
    assert abs(float(along)) > 1e-3
    np.testing.assert_allclose(float(along), float(numeric), rtol=2e-2)


def test_the_loss_falls(trained):
    *_, first, last, summary = trained
    assert summary["steps"] == 300
    assert last < 0.6 * first, (first, last)


def test_a_trained_draft_accepts_more_than_a_random_one_and_decodes_the_plain_greedy_text(trained):
    model, random_draft, draft, data, *_ = trained
    prompts = [list(map(int, data.tokens[i, : data.starts[i] + 1])) for i in range(4)]
    plain, _ = Engine(model, batch_size=4, chunk_length=16).generate(prompts, max_new_tokens=16)
    accept = {}
    spec = SpecConfig(num_iter=3, topk_per_iter=4, tree_size=8)
    for name, d in (("random", random_draft), ("trained", draft)):
        engine = SpeculativeEngine(model, d, spec=spec, batch_size=4, chunk_length=16, decode_block=4)
        out, stats = engine.generate(prompts, max_new_tokens=16)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain], name
        accept[name] = stats.spec_summary()["mean_accept_length"]
    assert accept["trained"] >= accept["random"] + 0.5, accept


def test_an_eagle3_draft_trains_over_its_own_vocabulary_and_loads_back(trained, tmp_path):
    """EAGLE-3 with a draft vocabulary of the data's most frequent tokens: d2t maps it, the training-time
    test runs over it, and the saved draft (SafeAILab names) loads with the same vocabulary and logits."""
    model, *_, data = trained[:4]
    ids = frequent_ids(data.token_counts(VOCAB), 12, keep=[2])
    draft = new_draft(model, "eagle3", vocab_ids=ids, seed=4)
    np.testing.assert_array_equal(np.asarray(draft.target_ids()), np.sort(ids))
    cfg = dataclasses.replace(RESUME_CFG, objective=Objective.for_kind("eagle3", 2), steps=3, eval_every=0)
    trainer = DraftTrainer(model, draft, data, cfg)
    before, _ = trainer.loss_and_metrics(np.arange(4))
    trainer.run(progress=False)
    after, _ = trainer.loss_and_metrics(np.arange(4))
    assert after < before
    save_draft(trainer.draft(), str(tmp_path / "e3"))
    back = load_draft(str(tmp_path / "e3"), model.config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(back.target_ids()), np.sort(ids))
    h = jax.random.normal(jax.random.key(5), (2, model.config.hidden_size))
    np.testing.assert_allclose(np.asarray(back.logits(h)), np.asarray(trainer.draft().logits(h)), rtol=1e-5, atol=1e-5)


def test_a_saved_draft_loads_back_in_bfloat16_and_in_vllm_layout(trained, tmp_path):
    model, *_ = trained
    draft = _draft(model, "minicpm", seed=3)
    for name, kw, tol in (("bf16", dict(dtype="bfloat16"), 1e-2), ("vllm", dict(layout="vllm", target=model), 0)):
        save_draft(draft, str(tmp_path / name), **kw)
        back = load_draft(str(tmp_path / name), model.config, max_length=MAX_LEN, attention_impl="xla",
                          dtype=jnp.float32)
        for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(draft)), nnx.to_flat_state(nnx.state(back))):
            np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), rtol=tol, atol=tol, err_msg=str(path))
    with pytest.raises(MiniCPMError, match="vLLM's layout is for MiniCPM"):
        save_draft(_draft(model, "llama"), str(tmp_path / "x"), layout="vllm", target=model)


def test_a_resumed_run_continues_where_it_stopped(tmp_path):
    model = _target()
    data = _greedy_data(model, n=16, new=8)
    cfg = RESUME_CFG
    straight = DraftTrainer(model, _draft(model), data, cfg)
    straight.run(progress=False)

    def interrupt(record):  # Ctrl-C after step 3: the trainer checkpoints before it propagates
        raise KeyboardInterrupt

    first = DraftTrainer(model, _draft(model), data, cfg, heldout=data, checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(KeyboardInterrupt):
        first.run(progress=False, log=interrupt)
    resumed = DraftTrainer(model, _draft(model, seed=7), data, cfg, checkpoint_dir=str(tmp_path / "ck"))
    assert resumed.step == 3
    resumed.run(progress=False)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    with pytest.raises(MiniCPMError, match="learning_rate"):
        DraftTrainer(model, _draft(model), data, dataclasses.replace(cfg, learning_rate=2e-3),
                     checkpoint_dir=str(tmp_path / "ck"))


def test_data_parallel_steps_equal_one_device():
    model = _target()
    data = _greedy_data(model, n=16, new=8)
    cfg = RESUME_CFG  # the resume test's settings: the one-device programs are compiled once for both
    one = DraftTrainer(model, _draft(model), data, cfg, devices=jax.devices()[:1])
    two = DraftTrainer(model, _draft(model), data, cfg, devices=jax.devices()[:2])
    one.run(progress=False)
    two.run(progress=False)
    assert all(len(x.sharding.device_set) == 2 for x in jax.tree.leaves(two.params))
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    with pytest.raises(MiniCPMError, match="multiple of the 3 devices"):
        DraftTrainer(model, _draft(model), data, cfg, devices=jax.devices()[:3])


def test_id_records_their_trained_positions_and_bad_records(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6, 7]}) + "\n\n"
                    + json.dumps({"prompt_ids": [9], "answer_ids": [8, 7]}) + "\n")
    seqs = pack(read_examples(str(good), None, VOCAB), 5)
    np.testing.assert_array_equal(seqs.tokens, [[1, 2, 3, 4, 5], [9, 8, 7, 0, 0]])
    np.testing.assert_array_equal(seqs.lengths, [5, 3])
    np.testing.assert_array_equal(seqs.starts, [2, 0])
    assert seqs.trained_tokens() == 3 + 3
    counts = seqs.token_counts(VOCAB)  # tokens after a trained position: 4 5 | 8 7
    assert counts[[4, 5, 8, 7]].tolist() == [1, 1, 1, 1] and counts.sum() == 4
    for line, message in (("{", "d.jsonl:1: not a JSON record"),
                          ('{"prompt_ids": [1, 99]}', "outside the vocabulary"),
                          ('{"x": 1}', "needs prompt_ids/answer_ids"),
                          ('{"text": "hi"}', "need the target's tokenizer")):
        bad = tmp_path / "d.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(MiniCPMError, match=message):
            read_examples(str(bad), None, VOCAB)
    with pytest.raises(MiniCPMError, match="does not exist"):
        read_examples(str(tmp_path / "none.jsonl"), None, VOCAB)
    with pytest.raises(MiniCPMError, match="no sequence"):
        pack([Example([1, 2], 0)], 8)


def test_batches_are_a_pure_function_of_the_step_and_cover_each_epoch():
    rows = [batch_rows(10, 4, s, seed=3) for s in range(5)]  # 20 draws = two epochs of 10
    flat = np.concatenate(rows)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    np.testing.assert_array_equal(batch_rows(10, 4, 3, seed=3), rows[3])
    assert not np.array_equal(batch_rows(10, 4, 0, seed=4), rows[0])
    data = Sequences(np.zeros((20, 4), np.int32), np.full(20, 4, np.int32), np.zeros(20, np.int32))
    train, held = split_heldout(data, 0.1, 0)
    assert (len(train), len(held)) == (18, 2)
    assert split_heldout(data, 0.0, 0)[1] is None


def test_frequent_ids_rank_by_count_and_keep_the_stop_ids():
    counts = np.asarray([5, 0, 9, 9, 1, 0])
    np.testing.assert_array_equal(frequent_ids(counts, 3), [2, 3, 0])
    np.testing.assert_array_equal(frequent_ids(counts, 3, keep=[5]), [2, 3, 5])
    with pytest.raises(MiniCPMError, match="vocabulary size"):
        frequent_ids(counts, 7)
