"""Random-weight model directories (``benchmarks/random_checkpoint.py``, what the GPU serving benchmark
serves): the model directory loads through the library with the weights of ``random_model``, its tokenizer has
exactly the shape's vocabulary and decodes every id to text, the draft and FR-Spec subset load, and a second
call keeps what exists."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import random_checkpoint
from benchmarks.serve import WORDS
from benchmarks.shapes import SHAPES, random_model
from minicpm_jax.config import ModelConfig
from minicpm_jax.io.frspec import read_frspec
from minicpm_jax.model.loading import load_draft, load_model
from minicpm_jax.tokenizer import load_tokenizer


def test_random_checkpoint_directories_load_and_hold_the_random_weights(tmp_path):
    paths = random_checkpoint.main(["--shape", "minicpm4-tiny", "--out", str(tmp_path), "--draft", "--frspec", "64"])
    vocab = SHAPES["minicpm4-tiny"]["vocab_size"]

    model = load_model(paths["model"], max_length=64, attention_impl="xla")
    expected = random_model(ModelConfig.from_dict(SHAPES["minicpm4-tiny"]), max_length=256, dtype=jnp.bfloat16)
    got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(expected, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(got[path][...], np.float32), np.asarray(var[...], np.float32))
    assert model.config.eos_token_ids == (2,)

    tok = load_tokenizer(paths["model"])
    assert len(tok) == vocab
    ids = tok.encode("alpha bravo zulu", add_special_tokens=False)
    assert len(ids) == 3 and tok.unk_token_id not in ids and tok.decode(ids) == "alpha bravo zulu"
    assert all(tok.decode([i]) for i in range(3, vocab))  # every non-special id is a word
    assert tok.convert_ids_to_tokens(3 + len(WORDS)) == f"w{3 + len(WORDS)}" and tok.convert_ids_to_tokens(vocab - 1) == f"w{vocab - 1}"

    draft = load_draft(paths["draft"], model.config, max_length=64, attention_impl="xla", dtype=jnp.float32)
    assert draft.spec.kind == "minicpm" and draft.spec.layer.hidden_size == model.config.hidden_size
    subset = read_frspec(paths["frspec"], vocab)
    assert len(subset) == 64 and len(set(subset.tolist())) == 64 and subset.max() < vocab

    before = {p: os.path.getmtime(p) for p in paths.values()}
    random_checkpoint.main(["--shape", "minicpm4-tiny", "--out", str(tmp_path), "--draft", "--frspec", "64"])
    assert {p: os.path.getmtime(p) for p in paths.values()} == before
