"""``--max_length auto`` on a GPU (run on the device with ``pytest -m gpu``): the length sized from the
allocator's budget is allocated for real, and a cache twice as long gives the one-line error, not an XLA
traceback. MiniCPM4-8B's layer shapes, 8 of its 32 layers, bf16, random weights."""

import dataclasses

import jax.numpy as jnp
import pytest

from benchmarks.shapes import SHAPES, random_model
from minicpm_jax.config import ModelConfig
from minicpm_jax.engine import memory
from minicpm_jax.engine.engine import allocate_cache
from minicpm_jax.errors import MiniCPMError

pytestmark = pytest.mark.gpu


def test_auto_length_fits_the_gpu_and_twice_that_is_a_clear_error():
    cfg = dataclasses.replace(ModelConfig.from_dict(SHAPES["minicpm4-8b"]), num_layers=8)
    batch = 192  # enough rows that memory, not the 131072 positions, bounds the length
    sizing = dict(batch_size=batch, dtype=jnp.bfloat16, sparse=None, chunk_length=512)
    # On a GPU the budget is what the allocator has left: measured with the weights already resident.
    small = random_model(cfg, 64, jnp.bfloat16, "pallas")
    budget = memory.device_budget(0.9)
    n = memory.auto_max_length(cfg, weights=0, budget=budget, **sizing)
    assert 1024 <= n < cfg.context_limit and n % memory.BLOCK == 0
    cache = small.new_cache(batch, n)  # allocates: the sized length really fits
    assert cache.k.nbytes + cache.v.nbytes > 0.5 * budget
    del cache
    with pytest.raises(MiniCPMError, match=r"max_length \d+ does not fit in memory"):
        memory.check_fits(cfg, max_length=2 * n, weights=0, budget=budget, **sizing)
    too_long = random_model(cfg, 2 * n, jnp.bfloat16, "pallas")
    with pytest.raises(MiniCPMError, match="does not fit in the accelerator's memory"):
        allocate_cache(too_long, batch)
