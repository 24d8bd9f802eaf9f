"""Tensor parallelism on several GPUs (``pytest -m gpu`` on a machine with 2+ GPUs; skipped on one): the
Pallas kernels per shard under the SPMD program, NCCL collectives, the split model against the same weights
on one GPU — fp32 logits and greedy tokens for dense, int4, InfLLM-v2 sparse and speculative decoding, and
bf16 within its rounding — and the compiled decode step's collectives. The CPU version of these checks,
with 2, 4 and 8 devices: ``tests/model/test_tensor_parallel.py``."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import SpeculativeEngine
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.loading import convert_model, shard_model
from minicpm_jax.model.parallel import make_mesh, use_peer_all_reduce
from minicpm_jax.quant import QuantSpec
from tests import helpers
from tests.helpers import SMALL

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(jax.devices()) < 2 or jax.default_backend() != "gpu", reason="needs 2+ GPUs")]

CONFIG = ModelConfig.from_dict(helpers.tiny_minicpm_config(intermediate_size=256, head_dim=64, num_attention_heads=8,
                                                           num_key_value_heads=2, hidden_size=256))
PROMPTS = [list(np.random.default_rng(i).integers(3, 97, n)) for i, n in enumerate((70, 9, 41, 1))]


def _model(mode: str, dtype, max_length: int = 128):
    model = MiniCPMForCausalLM(CONFIG, max_length=max_length, attention_impl="pallas", dtype=dtype, rngs=nnx.Rngs(0),
                               sparse=SMALL if mode == "sparse" else "off")
    # A sharp embedding → lm_head path: greedy tokens have wide margins, so bf16 rounding cannot flip them.
    model.model.embed_tokens.embedding.set_value(model.model.embed_tokens.embedding[...] * 40.0)
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * 40.0)
    return convert_model(model, QuantSpec(group_size=32)) if mode == "int4" else model


def _run(model, draft=None):
    if draft is None:
        engine = Engine(model, batch_size=4, chunk_length=32, decode_block=4)
    else:
        engine = SpeculativeEngine(model, nnx.merge(*nnx.split(draft)), batch_size=4, chunk_length=32, decode_block=2)
    logits = np.asarray(engine.prefill(PROMPTS), np.float32)
    engine.reset()
    results, _ = engine.generate(PROMPTS, max_new_tokens=24)
    return logits, [r.token_ids for r in results]


def _split(model, peer: bool):
    """``model`` over all GPUs; ``peer``: its sublayers reduce through the peer-memory kernel."""
    mesh = make_mesh(len(jax.devices()))
    use_peer_all_reduce(mesh, enable=peer)
    try:
        return shard_model(model, mesh)
    finally:
        use_peer_all_reduce(mesh, enable=False)


@pytest.mark.parametrize("mode,dtype,peer", [("dense", jnp.float32, False), ("int4", jnp.float32, False),
                                             ("sparse", jnp.float32, False), ("speculative", jnp.float32, False),
                                             ("dense", jnp.bfloat16, False), ("speculative", jnp.bfloat16, False),
                                             ("dense", jnp.float32, True), ("int4", jnp.float32, True),
                                             ("speculative", jnp.bfloat16, True)],
                         ids=["dense-fp32", "int4-fp32", "sparse-fp32", "speculative-fp32", "dense-bf16",
                              "speculative-bf16", "dense-fp32-peer", "int4-fp32-peer", "speculative-bf16-peer"])
def test_split_over_gpus_equals_one_gpu(mode, dtype, peer):
    one = _model(mode, dtype)
    draft = None
    if mode == "speculative":
        draft = EagleDraft(DraftSpec.for_target(CONFIG, "minicpm"), max_length=128, attention_impl="pallas",
                           dtype=dtype, rngs=nnx.Rngs(1))
    want_logits, want_tokens = _run(one, draft)
    got_logits, got_tokens = _run(_split(one, peer), draft)
    assert helpers.rel_err(got_logits, want_logits) < (1e-5 if dtype == jnp.float32 else 1e-2)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("mode,dtype,batch", [("dense", jnp.bfloat16, 1), ("dense", jnp.bfloat16, 4),
                                              ("int4", jnp.float32, 1)],
                         ids=["dense-bf16", "dense-bf16-rows", "int4-fp32"])
def test_decode_with_split_parts_equals_one_gpu(mode, dtype, batch, monkeypatch):
    """Decode through the peer kernels with K-split parts (``matmul_parts``, forced here into blocks of 32 rows of
    this small model's K; the int4 kernel's own): one row, and several (``dense-bf16-rows``: 4 parts, the q/k/v
    parts added by the RoPE kernel, o_proj's and down_proj's by the fused all-reduce), against one GPU."""
    from pallas_kernels import matmul as matmul_mod

    monkeypatch.setattr(matmul_mod, "SPLIT_ROWS", 32)
    one = _model(mode, dtype)

    def run(model):
        engine = Engine(model, batch_size=batch, chunk_length=32, decode_block=4)
        logits = np.asarray(engine.prefill(PROMPTS[:batch]), np.float32)
        engine.reset()
        return logits, [r.token_ids for r in engine.generate(PROMPTS[:batch], max_new_tokens=24)[0]]

    want_logits, want_tokens = run(one)
    got_logits, got_tokens = run(_split(one, peer=True))
    assert helpers.rel_err(got_logits, want_logits) < (1e-5 if dtype == jnp.float32 else 1e-2)
    assert got_tokens == want_tokens


def test_a_wide_prefill_chunk_reduced_in_bf16_keeps_one_gpus_tokens():
    """A bf16 prefill chunk whose messages exceed ``WIDE_MESSAGE`` elements is all-reduced in bf16 (NCCL,
    ``pallas_kernels.residual``): the split model's logits stay within bf16 rounding of one GPU's and its
    greedy tokens are the same."""
    from pallas_kernels.residual import WIDE_MESSAGE

    prompt = [list(np.random.default_rng(7).integers(3, 97, WIDE_MESSAGE // CONFIG.hidden_size + 40))]
    one = _model("dense", jnp.bfloat16, max_length=len(prompt[0]) + 40)

    def run(model):
        engine = Engine(model, batch_size=1, chunk_length=2048, decode_block=4)
        logits = np.asarray(engine.prefill(prompt), np.float32)
        engine.reset()
        return logits, engine.generate(prompt, max_new_tokens=24)[0][0].token_ids

    want_logits, want_tokens = run(one)
    got_logits, got_tokens = run(_split(one, peer=True))
    assert helpers.rel_err(got_logits, want_logits) < 1e-2
    assert got_tokens == want_tokens


@pytest.mark.parametrize("peer", [False, True], ids=["xla", "peer"])
def test_decode_step_collectives_on_gpus(peer):
    model = _split(_model("dense", jnp.bfloat16), peer)
    engine = Engine(model, batch_size=1, chunk_length=32, decode_block=1)
    steps = engine.steps
    hlo = steps.compiled.jitted["decode"].lower(steps.state, engine.cache, engine.decode_state([], [], []),
                                                mode="dense", sampling="auto").compile().as_text()
    ops = collections.Counter(re.findall(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                                         r"(?:-start)?\(", hlo))
    # With the peer kernel every collective leaves XLA's (they are Triton calls in the step's graph): the
    # sublayers' 2 all-reduces a layer, the embedding lookup's, and the logits' gather (a sum of placed blocks).
    assert ops == ({} if peer else {"all-reduce": 2 * CONFIG.num_layers + 1, "all-gather": 1})
