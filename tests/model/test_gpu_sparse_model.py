"""The InfLLM-v2 sparse model on the GPU (``pytest -m gpu``): a sparse tiny model on the GPU (Pallas) against
the CPU (references), and speculative-tree verification over InfLLM-v2 compiled by Triton against the jnp
path. The kernels: ``tests/kernels/test_gpu_infllm_kernels.py``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.infllm.attention import tree_sparse_attention
from minicpm_jax.infllm.compressed import extend_compressed
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from pallas_kernels import backend
from tests import helpers
from tests.helpers import SMALL, random_tree

pytestmark = pytest.mark.gpu


def test_gpu_sparse_model_matches_cpu_and_generates_the_same():
    config = ModelConfig.from_dict(helpers.tiny_minicpm_config(sparse_config=dataclasses.asdict(SMALL)))
    ids = np.random.default_rng(0).integers(0, 97, (1, 100))
    prompts = [list(np.random.default_rng(1).integers(3, 97, 12)), list(np.random.default_rng(2).integers(3, 97, 60))]
    out = {}
    for name, device in (("cpu", jax.devices("cpu")[0]), ("gpu", jax.devices("gpu")[0])):
        with jax.default_device(device):
            model = MiniCPMForCausalLM(config, max_length=128, attention_impl="xla" if name == "cpu" else "pallas",
                                       rngs=nnx.Rngs(0), dtype=jnp.float32)
            logits, _, _ = jax.jit(lambda m, c, x: m(x, c))(model, model.new_cache(1), jnp.asarray(ids, jnp.int32))
            engine = Engine(model, batch_size=2, chunk_length=16)
            out[name] = (np.asarray(logits), [r.token_ids for r in engine.generate(prompts, max_new_tokens=40)[0]])
    assert helpers.rel_err(out["gpu"][0], out["cpu"][0]) < 1e-4
    assert out["gpu"][1] == out["cpu"][1]


@pytest.mark.parametrize("t", [12, 32])
def test_tree_sparse_attention_pallas_matches_reference_at_8b_dims(t):
    """Speculative-tree verification over InfLLM-v2 (stage 1 with each node's extra coarse key, selection,
    the block-sparse kernel's LSE merged with the ancestors) compiled by Triton, against the jnp path, at
    MiniCPM4-8B attention dims and MiniCPM4's sparse_config, fp32 so both select the same blocks; 12 nodes
    (4-token stage-1 tiles, the ancestors padded to 16 in the merge kernel) and 32."""
    sp = SparseConfig(dense_len=1024)
    cfg = ModelConfig.from_dict(helpers.tiny_minicpm_config(num_attention_heads=32, num_key_value_heads=2,
                                                            head_dim=128, hidden_size=4096, rope_scaling=None))
    length, prefix = 8192, 6000
    rng = np.random.default_rng(0)
    depth, mask = random_tree(rng, t, 3)
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    cache = KVCache.create(cfg, 1, length, jnp.float32, sp)
    cache = dataclasses.replace(cache, k=jax.random.normal(keys[0], cache.k.shape), v=jax.random.normal(keys[1], cache.v.shape))
    pre = jnp.array([prefix], jnp.int32)
    cache = extend_compressed(cache, 0, jnp.zeros((1,), jnp.int32), pre, sp, max_tokens=length,
                              kernels=backend.get("xla"))
    q = jax.random.normal(keys[2], (1, t, 32, 128)) * 0.3
    tree_k = jax.random.normal(keys[3], (1, t, 2, 128))
    tree_v = jax.random.normal(keys[4], (1, t, 2, 128))
    args = (q, q, tree_k, tree_v, jnp.asarray(mask[None]), cache, 0, pre, jnp.asarray(depth[None], jnp.int32), sp)
    got = tree_sparse_attention(*args, scale=128**-0.5, kernels=backend.get("pallas"))
    want = tree_sparse_attention(*args, scale=128**-0.5, kernels=backend.get("xla"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def test_gpu_paged_sparse_engine_generates_the_cpu_contiguous_tokens():
    """InfLLM-v2 over pages on the GPU (the Pallas kernels with page tables: paged stage 1, the decode path,
    the local-window split, the paged compress step) generates the tokens of the contiguous cache's
    references on the CPU, for prompts below and past dense_len."""
    from minicpm_jax.engine.paging import Paging

    sp = SparseConfig(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=16, window_size=32, topk=3,
                      use_nope=False, dense_len=48)
    config = ModelConfig.from_dict(helpers.tiny_minicpm_config(sparse_config=dataclasses.asdict(sp)))
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, 97, n)] for n in (12, 100)]
    out = {}
    for name, device in (("cpu", jax.devices("cpu")[0]), ("gpu", jax.devices("gpu")[0])):
        with jax.default_device(device):
            model = MiniCPMForCausalLM(config, max_length=256, attention_impl="xla" if name == "cpu" else "pallas",
                                       rngs=nnx.Rngs(0), dtype=jnp.float32)
            paging = None if name == "cpu" else Paging(num_pages=40, page_size=16)
            engine = Engine(model, batch_size=2, chunk_length=32, paging=paging)
            out[name] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=60)[0]]
    assert out["gpu"] == out["cpu"]
