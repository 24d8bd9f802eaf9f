"""The KV caches are updated in place: no compiled engine step copies a whole cache.

XLA copies a donated buffer whenever a read of one version of it may be ordered after a write of the
next, and such a copy costs a read and a write of the whole cache (4.3 GB at 128K for MiniCPM4-8B) per
occurrence. Two were found this way: a sparse model's dense layers reading their keys for K1/K2 while the
next layer wrote the same buffer (a copy per layer, prefill and decode), and the draft cache copied every
speculative round because the tree expansion's writes were dropped. The oracle is XLA's own compiled
program: its ``copy`` instructions of a cache-shaped buffer."""

import re

import jax.numpy as jnp
import pytest
from flax import nnx

from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import SpeculativeEngine
from minicpm_jax.engine.speculative.rounds import SpecConfig
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from tests.helpers import tiny_minicpm_config

MAX_LEN = 256
SPARSE = {"kernel_size": 4, "kernel_stride": 2, "init_blocks": 1, "block_size": 8, "window_size": 16, "topk": 4,
          "use_nope": False, "dense_len": 48}
PROMPT = list(range(3, 33))  # 30 tokens: prefill and the first decode steps dense, then sparse past 48


def cache_copies(compiled, shapes: set[tuple[int, ...]]) -> list[str]:
    """The ``copy`` instructions of any executable in ``compiled`` (an engine's ``Compiled``) whose result
    has one of ``shapes``, as ``"step: instruction"``."""
    found = []
    for key, exe in compiled.executables.items():
        for line in exe.as_text().splitlines():
            m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* copy\(", line)
            if m and tuple(int(x) for x in m.group(1).split(",") if x) in shapes:
                found.append(f"{key[0]}: {line.strip()[:120]}")
    return found


@pytest.fixture(scope="module")
def sparse_model():
    cfg = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=40, sparse_config=SPARSE))
    return MiniCPMForCausalLM(cfg, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(0),
                              sparse="on")


def _shapes(cache) -> set[tuple[int, ...]]:
    """The shapes of a cache's big buffers (K/V, a contiguous cache's compressed keys; a paged pool)."""
    return {tuple(x.shape) for x in (cache.k, cache.v, getattr(cache, "k1", None), getattr(cache, "k2", None))
            if x is not None}


def test_plain_steps_of_a_sparse_model_write_the_cache_in_place(sparse_model):
    engine = Engine(sparse_model, batch_size=1, chunk_length=16, decode_block=4)
    engine.generate([PROMPT], max_new_tokens=40)
    modes = {dict(key[2]).get("mode") for key in engine.steps.compiled.executables}
    assert {"dense", "sparse"} <= modes  # both sides of dense_len were compiled and checked
    assert cache_copies(engine.steps.compiled, _shapes(sparse_model.new_cache(1))) == []


def test_speculative_rounds_write_both_caches_in_place(sparse_model):
    draft = EagleDraft(DraftSpec.for_target(sparse_model.config), max_length=MAX_LEN, attention_impl="xla",
                       dtype=jnp.float32, rngs=nnx.Rngs(1))
    engine = SpeculativeEngine(sparse_model, draft, spec=SpecConfig(num_iter=2, topk_per_iter=3, tree_size=6),
                               batch_size=1, chunk_length=16, decode_block=2)
    engine.generate([PROMPT], max_new_tokens=40)
    shapes = _shapes(sparse_model.new_cache(1)) | _shapes(engine.steps.dcache)
    assert cache_copies(engine.steps.compiled, shapes) == []


@pytest.mark.parametrize("draft_kind,sparse", [(None, False), ("minicpm", False), (None, True)])
def test_paged_steps_write_the_pool_in_place(draft_kind, sparse):
    """The paged pool through every program a server runs: prompt pieces over some rows, decode blocks over
    a subset of rows (plain) or every row (speculative rounds, whose trees sit in the scratch regions and
    whose accepted paths are copied into the pages); sparse: InfLLM-v2 over the pages, its compressed-key
    pools written in place too, across dense_len."""
    from minicpm_jax.engine.paging import Paging
    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.engine.scheduler import Request, Scheduler

    paged_sparse = {**SPARSE, "kernel_size": 8, "kernel_stride": 4, "block_size": 16, "window_size": 16,
                    "dense_len": 24}
    cfg = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=40, **({"sparse_config": paged_sparse} if sparse
                                                                       else {})))
    model = MiniCPMForCausalLM(cfg, max_length=64, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(0),
                               sparse="on" if sparse else "off")
    assert model.sparse_active == sparse
    paging = Paging(num_pages=12, page_size=16)
    if draft_kind is None:
        engine = Engine(model, batch_size=4, chunk_length=16, decode_block=1, paging=paging)
    else:
        draft = EagleDraft(DraftSpec.for_target(cfg, draft_kind), max_length=64, attention_impl="xla",
                           dtype=jnp.float32, rngs=nnx.Rngs(1))
        engine = SpeculativeEngine(model, draft, spec=SpecConfig(num_iter=2, topk_per_iter=3, tree_size=6),
                                   batch_size=4, chunk_length=16, decode_block=1, paging=paging)
    sched = Scheduler(engine, prefill_budget=16)
    for prompt in (PROMPT[:20], PROMPT[:5]):
        sched.submit(Request(prompt, SamplingParams(), 12, [], lambda _: False, lambda *_: None))
    while sched.active or sched.queued:
        sched.step()
    names = {key[0] for key in engine.steps.compiled.executables}
    assert {"prefill_rows", "decode" if draft_kind else "decode_rows"} <= names
    if sparse:
        modes = {dict(key[2]).get("mode") for key in engine.steps.compiled.executables}
        assert "dense" in modes and modes & {"sparse", "mixed"} and engine.cache.k1 is not None
    shapes = _shapes(engine.cache) | (_shapes(engine.steps.dcache) if draft_kind else set())
    assert cache_copies(engine.steps.compiled, shapes) == []
