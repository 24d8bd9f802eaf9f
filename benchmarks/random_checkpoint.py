"""Random-weight model directories of a benchmark shape, for benchmarks that start a process on a model
directory (the serving benchmark runs ``python -m minicpm_jax.server --model_path DIR``)::

    python -m benchmarks.random_checkpoint --shape minicpm4-8b --out /tmp/random-8b [--draft] [--frspec 32768]

writes ``OUT/model`` (a native checkpoint of :func:`benchmarks.shapes.random_model`'s weights with a word-level
tokenizer of the shape's vocabulary), and with ``--draft`` ``OUT/draft`` (a random EAGLE draft for it) and
``--frspec V`` ``OUT/freq_V.npy`` (V random token ids, an FR-Spec subset). Each is written to a temporary
name and renamed into place; existing ones are kept (a second call is free).

The tokenizer is a :mod:`tokenizers` WordLevel model: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the words of
:data:`benchmarks.serve.WORDS`, then ``w3 w4 …`` up to the vocabulary size, split on whitespace and
punctuation, decoded with a space between words (the default of a tokenizer without a decoder). Every id decodes to text, so a stream of random tokens
is a stream of text chunks. Random weights say nothing of quality: these directories measure time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

SPECIALS = ("<unk>", "<s>", "</s>")


def word_tokenizer(vocab_size: int, words: list[str]):
    """A ``tokenizers.Tokenizer`` of exactly ``vocab_size`` ids (see the module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    i = len(vocab)
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    if len(vocab) > vocab_size:
        raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold {len(vocab)} words")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _atomic_dir(dst: str, write) -> None:
    """Runs ``write(tmp)`` on an empty ``dst.tmp`` and renames it to ``dst``; an existing ``dst`` is kept."""
    if os.path.isdir(dst):
        return
    tmp = dst.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    os.replace(tmp, dst)


def write_model(shape: str, dst: str, dtype: str = "bfloat16") -> None:
    """``dst``: a native checkpoint of ``shape`` with random weights and a word-level tokenizer."""
    import jax.numpy as jnp

    from benchmarks.serve import WORDS
    from benchmarks.shapes import SHAPES, random_model
    from minicpm_jax.config import ModelConfig
    from minicpm_jax.model.loading import save_native

    config = ModelConfig.from_dict(dict(SHAPES[shape], bos_token_id=1, eos_token_id=2))

    def write(tmp: str) -> None:
        save_native(random_model(config, max_length=256, dtype=jnp.dtype(dtype)), tmp)
        word_tokenizer(config.vocab_size, list(WORDS)).save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                       "eos_token": "</s>", "model_max_length": config.max_position_embeddings}, f, indent=1)

    _atomic_dir(dst, write)


def write_draft(shape: str, dst: str) -> None:
    """``dst``: a random EAGLE draft (the kind :class:`~minicpm_jax.config.DraftSpec` picks for ``shape``)."""
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.shapes import SHAPES
    from minicpm_jax.config import DraftSpec, ModelConfig
    from minicpm_jax.model.draft import EagleDraft
    from minicpm_jax.model.loading import save_draft

    if os.path.isdir(dst):
        return
    config = ModelConfig.from_dict(SHAPES[shape])
    draft = EagleDraft(DraftSpec.for_target(config), max_length=256, attention_impl="xla", dtype=jnp.float32,
                       rngs=nnx.Rngs(1))
    save_draft(draft, dst)  # written atomically


def write_frspec(shape: str, size: int, dst: str) -> None:
    """``dst`` (.npy): ``size`` distinct random token ids of ``shape``'s vocabulary."""
    import numpy as np

    from benchmarks.shapes import SHAPES

    if os.path.exists(dst):
        return
    ids = np.random.default_rng(2).permutation(SHAPES[shape]["vocab_size"])[:size].astype(np.int64)
    tmp = dst + ".tmp.npy"
    np.save(tmp, ids)
    os.replace(tmp, dst)


def main(argv: list[str] | None = None) -> dict[str, str]:
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m benchmarks.random_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="directory for model/ (and draft/, freq_V.npy)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--draft", action="store_true", help="also a random EAGLE draft")
    p.add_argument("--frspec", type=int, default=0, help="also an FR-Spec subset of this many ids")
    args = p.parse_args(argv)
    paths = {"model": os.path.join(args.out, "model")}
    os.makedirs(args.out, exist_ok=True)
    write_model(args.shape, paths["model"], args.dtype)
    if args.draft:
        paths["draft"] = os.path.join(args.out, "draft")
        write_draft(args.shape, paths["draft"])
    if args.frspec:
        paths["frspec"] = os.path.join(args.out, f"freq_{args.frspec}.npy")
        write_frspec(args.shape, args.frspec, paths["frspec"])
    print(json.dumps(paths), flush=True)
    print(f"random {args.shape} written under {args.out}", file=sys.stderr)
    return paths


if __name__ == "__main__":
    main()
