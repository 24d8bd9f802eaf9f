"""How long a context a model runs: YaRN against transformers' own rope functions, MiniCPM4's validated
128K LongRoPE factors (``--minicpm4_yarn``), the positions a config supports, InfLLM-v2 with
``dense_len = -1`` (always sparse), and the KV cache sized from memory (``--max_length auto``)."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine import memory
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.policy import attention_mode
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.loading import check_max_length, load_model, target_config, weight_bytes
from minicpm_jax.model.rope import rope_frequencies
from minicpm_jax.rope_config import LONGROPE_CONTEXT, MINICPM4_YARN_FACTORS
from tests import helpers
from tests.helpers import SMALL

LLAMA = dict(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
             rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
YARNS = [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=128, beta_fast=16, beta_slow=2, mscale=1.0,
         mscale_all_dim=0.5),
    dict(rope_type="yarn", factor=4.0, attention_factor=1.3, truncate=False, original_max_position_embeddings=256),
    dict(rope_type="yarn", factor=2.0),  # the pre-training context defaults to max_position_embeddings
]


@pytest.mark.parametrize("scaling", YARNS)
def test_yarn_frequencies_and_amplitude_equal_transformers(scaling):
    raw = dict(LLAMA, rope_scaling=scaling)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig(**raw), "cpu")
    cfg = ModelConfig.from_dict(raw)
    freq, scale = rope_frequencies(cfg.rope, cfg.head_dim, 512, cfg.max_position_embeddings)
    np.testing.assert_allclose(freq, want_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-9) and scale > 1
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    orig = scaling.get("original_max_position_embeddings", 1024)
    assert cfg.context_limit == max(1024, int(orig * scaling["factor"]))


def test_yarn_model_logits_equal_transformers_llama(tmp_path):
    raw = dict(LLAMA, rope_scaling=YARNS[0])
    weights = helpers.random_hf_weights(raw, seed=3)
    path = helpers.write_checkpoint(str(tmp_path / "yarn"), raw, weights)
    ids = np.random.default_rng(0).integers(0, 101, 300)
    model = load_model(path, dtype=jnp.float32, attention_impl="xla", max_length=512)
    ours = np.asarray(model(jnp.asarray([ids], jnp.int32), model.new_cache(1))[0][0])
    hf = LlamaForCausalLM(LlamaConfig(**raw)).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert helpers.rel_err(ours, want) < 1e-4


def _minicpm4_like(**overrides) -> dict:
    """MiniCPM4's head_dim 128 and 32K LongRoPE, shrunk elsewhere."""
    rng = np.random.default_rng(5)
    cfg = helpers.tiny_minicpm_config(head_dim=128, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32768)
    cfg["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": 32768,
                           "short_factor": [float(x) for x in 1 + rng.random(64)],
                           "long_factor": [float(x) for x in 1 + rng.random(64)]}
    cfg.update(overrides)
    return cfg


def test_minicpm4_yarn_factors_replace_the_config_list_and_reach_the_draft(tmp_path):
    cfg = _minicpm4_like()
    path = helpers.write_checkpoint(str(tmp_path / "m4"), cfg, helpers.random_hf_weights(cfg))
    plain, yarn = target_config(path), target_config(path, minicpm4_yarn=True)
    assert len(MINICPM4_YARN_FACTORS) == 64 and MINICPM4_YARN_FACTORS[0] == pytest.approx(0.9977997200264581)
    assert yarn.rope.short_factor == yarn.rope.long_factor == MINICPM4_YARN_FACTORS
    assert yarn.rope.original_max_position_embeddings == 32768 and plain.rope != yarn.rope
    # The factors divide the base frequencies; max_position_embeddings == original keeps the amplitude 1
    # (CPM.cu discards it; HF's MiniCPMLongRoPE computes 1 here).
    freq, scale = rope_frequencies(yarn.rope, 128, 65536, yarn.max_position_embeddings)
    base = 1.0 / 10000.0 ** (np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(freq, base / np.asarray(MINICPM4_YARN_FACTORS), rtol=1e-6)
    assert scale == 1.0
    model = load_model(path, dtype=jnp.float32, attention_impl="xla", max_length=256, minicpm4_yarn=True)
    assert model.config.rope == yarn.rope
    assert DraftSpec.for_target(model.config, "eagle3").layer.rope == yarn.rope  # the draft shares the target's
    with pytest.raises(MiniCPMError, match="head_dim 128"):
        target_config(helpers.write_checkpoint(str(tmp_path / "tiny"), helpers.tiny_minicpm_config(),
                                               helpers.random_hf_weights(helpers.tiny_minicpm_config())),
                      minicpm4_yarn=True)


def test_positions_past_the_context_are_refused_with_the_fix():
    m4 = ModelConfig.from_dict(_minicpm4_like())
    assert m4.context_limit == LONGROPE_CONTEXT  # MiniCPM's LongRoPE: validated to 128K
    check_max_length(m4, LONGROPE_CONTEXT)
    with pytest.raises(MiniCPMError, match="exceeds the 131072 positions.*--minicpm4_yarn"):
        check_max_length(m4, 5_000_000)
    with pytest.raises(MiniCPMError, match=r"exceeds the 131072 positions .*lower --max_length$"):
        check_max_length(m4.with_minicpm4_yarn(), 5_000_000)  # already on: nothing else to suggest
    llama = ModelConfig.from_dict(LLAMA)
    assert llama.context_limit == 1024
    with pytest.raises(MiniCPMError, match="exceeds the 1024 positions.*rope_scaling"):
        check_max_length(llama, 1025)
    with pytest.raises(MiniCPMError, match="at least 2"):
        check_max_length(llama, 1)


# ------------------------------------------------------------------------- InfLLM-v2: dense_len -1
_forward = jax.jit(lambda m, c, x: m(x, c))  # one program per forward, as the engine runs it (eager: ~3x slower)


def _sparse_model(sparse):
    raw = helpers.tiny_minicpm_config(sparse_config=dataclasses.asdict(sparse))
    return MiniCPMForCausalLM(ModelConfig.from_dict(raw), max_length=128, attention_impl="xla", rngs=nnx.Rngs(0),
                              sparse=sparse)


def test_dense_len_minus_one_is_sparse_from_the_first_token():
    raw = helpers.tiny_minicpm_config(sparse_config=dict(dataclasses.asdict(SMALL), dense_len=-1))
    parsed = ModelConfig.from_dict(raw).sparse
    assert parsed.dense_len == -1 and parsed.always_sparse
    assert attention_mode(parsed.dense_len, 0, 1) == "sparse"
    with pytest.raises(MiniCPMError, match="dense_len must be an integer >= -1"):
        ModelConfig.from_dict(helpers.tiny_minicpm_config(sparse_config=dict(dataclasses.asdict(SMALL), dense_len=-2)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (1, 60)), jnp.int32)
    narrow = dataclasses.replace(SMALL, topk=1, window_size=8)  # 1 top-k block + an 8-token window
    models = {name: _sparse_model(sparse) for name, sparse in (
        ("minus1", dataclasses.replace(narrow, dense_len=-1)), ("from1", dataclasses.replace(narrow, dense_len=1)),
        ("from32", dataclasses.replace(narrow, dense_len=32)))}
    models["dense"] = MiniCPMForCausalLM(models["minus1"].config, max_length=128, attention_impl="xla",
                                         rngs=nnx.Rngs(0), sparse="off")

    def logits(name, n):
        return np.asarray(_forward(models[name], models[name].new_cache(1), ids[:, :n])[0][0])

    outs = {"minus1": logits("minus1", 60)}
    np.testing.assert_array_equal(outs["minus1"], logits("from1", 60))
    # a 20-token prompt: below dense_len 32 it is dense; with -1 it is sparse from its first chunk on
    short = {name: logits(name, 20) for name in ("minus1", "from32", "dense")}
    np.testing.assert_allclose(short["from32"], short["dense"], atol=1e-5)
    np.testing.assert_allclose(short["minus1"][:8], short["dense"][:8], atol=1e-5)  # the first block: all selected
    assert np.abs(short["minus1"][8:] - short["dense"][8:]).max() > 1e-3
    # prefill in chunks, then one decode step: the same last logits as one pass
    model = models["minus1"]
    cache = model.new_cache(1)
    for start in range(0, 59, 20):
        _, _, cache = _forward(model, cache, ids[:, start:min(start + 20, 59)])
    last, _, _ = _forward(model, cache, ids[:, 59:])
    np.testing.assert_allclose(np.asarray(last[0, -1]), outs["minus1"][-1], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- cache sized from memory
def test_auto_max_length_is_the_largest_block_multiple_that_fits():
    cfg = ModelConfig.from_dict(_minicpm4_like())
    kw = dict(batch_size=2, dtype=jnp.bfloat16, sparse=SMALL, weights=3 << 20, chunk_length=64)
    per_token = KVCache.nbytes(cfg, 2, 1024, jnp.bfloat16, SMALL) / 1024
    ws = memory.workspace_bytes(cfg, 2, 64, jnp.bfloat16)
    budget = int((3 << 20) + ws + 5000 * per_token)
    n = memory.auto_max_length(cfg, budget=budget, **kw)
    assert n % memory.BLOCK == 0 and 4000 < n <= 5000
    assert memory.plan(cfg, max_length=n, budget=budget, **kw).fits
    assert not memory.plan(cfg, max_length=n + memory.BLOCK, budget=budget, **kw).fits
    memory.check_fits(cfg, max_length=n, budget=budget, **kw)
    with pytest.raises(MiniCPMError, match=rf"max_length 100000 does not fit in memory: .*at most {n} fits"):
        memory.check_fits(cfg, max_length=100000, budget=budget, **kw)
    # a big budget stops at the positions the model supports
    assert memory.auto_max_length(cfg, budget=1 << 50, **kw) == cfg.context_limit
    with pytest.raises(MiniCPMError, match="the model does not fit"):
        memory.auto_max_length(cfg, budget=3 << 20, **kw)
    assert memory.device_budget(0.5) > 0
    with pytest.raises(MiniCPMError, match="memory_limit"):
        memory.device_budget(1.5)


def test_host_memory_counts_the_reclaimable_page_cache(tmp_path):
    # a host whose RAM is mostly page cache: MemFree is small, MemAvailable is what an allocation can get
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1363148 kB\n"
                       "MemAvailable:   20971520 kB\nBuffers:          102400 kB\n")
    assert memory.host_available_bytes(str(meminfo)) == 20 * memory.GiB
    # without the line (a kernel older than 3.14) or the file, the free pages are all we know
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1363148 kB\n")
    assert abs(memory.host_available_bytes(str(meminfo)) - free) < memory.GiB
    assert abs(memory.host_available_bytes(str(tmp_path / "absent")) - free) < memory.GiB


def test_weight_bytes_equal_the_loaded_parameters(tmp_path):
    cfg = helpers.tiny_minicpm_config()
    path = helpers.write_checkpoint(str(tmp_path / "w"), cfg, helpers.random_hf_weights(cfg))
    for quant in ("auto", "int4"):
        model = load_model(path, dtype=jnp.float32, attention_impl="xla", max_length=64, quant=quant, group_size=16)
        loaded = sum(math.prod(v.shape) * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(model)))
        assert weight_bytes(path, dtype=jnp.float32, quant=quant, group_size=16) == loaded
