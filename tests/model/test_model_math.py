"""MiniCPM4 math: the JAX model against transformers (scalings folded into a Llama) and a NumPy forward."""

import numpy as np
import jax.numpy as jnp
import pytest
import torch

from minicpm_jax.model.loading import load_model
from tests import helpers, oracles


def _logits(path, ids, max_length):
    model = load_model(path, dtype=jnp.float32, max_length=max_length)
    cache = model.new_cache(1, max_length)
    logits, hidden, _ = model(jnp.asarray([ids], jnp.int32), cache)
    assert hidden.shape == (1, len(ids), model.config.hidden_size)
    return np.asarray(logits[0])


@pytest.mark.parametrize(
    "regime, orig, max_length, seq",
    [("short_factor", 64, 64, 40), ("long_factor", 32, 128, 48)],
)
def test_minicpm4_matches_transformers_and_numpy(tmp_path, regime, orig, max_length, seq):
    cfg = helpers.tiny_minicpm_config()
    cfg["rope_scaling"]["original_max_position_embeddings"] = orig
    weights = helpers.random_hf_weights(cfg, seed=1)
    path = helpers.write_checkpoint(str(tmp_path / "ckpt"), cfg, weights)
    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], seq)

    ours = _logits(path, ids, max_length)

    hf = oracles.hf_llama_with_minicpm_folded(cfg, weights)
    with torch.no_grad():
        ref_hf = hf(torch.tensor(ids[None])).logits[0].numpy()
    ref_np = oracles.numpy_forward(cfg, weights, ids, max_length)

    assert helpers.rel_err(ours, ref_hf) < 1e-4, regime
    assert helpers.rel_err(ours, ref_np) < 1e-4, regime
    # The scalings matter: a neutral-scaling forward must not match.
    neutral = dict(cfg, scale_emb=1.0, scale_depth=float(np.sqrt(cfg["num_hidden_layers"])), dim_model_base=cfg["hidden_size"])
    assert helpers.rel_err(oracles.numpy_forward(neutral, weights, ids, max_length), ref_np) > 1e-2


def test_long_and_short_factors_differ(tmp_path):
    """Guards the regime test above: the two factor sets give different logits on the same tokens."""
    cfg = helpers.tiny_minicpm_config()
    weights = helpers.random_hf_weights(cfg, seed=3)
    ids = np.arange(20) % cfg["vocab_size"]
    short = oracles.numpy_forward(cfg, weights, ids, max_length=64)
    long = oracles.numpy_forward(cfg, weights, ids, max_length=65)
    assert helpers.rel_err(short, long) > 1e-3


def test_tied_head_and_llama_type(tmp_path):
    """A llama config (neutral scalings, tied head, default rope) against the NumPy forward."""
    cfg = helpers.tiny_minicpm_config(model_type="llama", tie_word_embeddings=True, rope_scaling=None)
    for k in ("scale_emb", "scale_depth", "dim_model_base"):
        cfg.pop(k)
    weights = helpers.random_hf_weights(cfg, seed=4)
    path = helpers.write_checkpoint(str(tmp_path / "ckpt"), cfg, weights)
    ids = np.random.default_rng(5).integers(0, cfg["vocab_size"], 33)
    assert helpers.rel_err(_logits(path, ids, 64), oracles.numpy_forward(cfg, weights, ids, 64)) < 1e-4
