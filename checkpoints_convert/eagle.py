"""``checkpoints_convert eagle``: EAGLE drafts between tensor layouts; ``checkpoints_convert frspec``:
FR-Spec vocabulary subsets from a corpus."""

from __future__ import annotations

import os
import shutil

import numpy as np
from safetensors.numpy import save_file

from checkpoints_convert.common import atomic_output_dir, check_destination, write_json
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.draft import draft_kind_of, engine_draft_names, read_draft_tensors, to_vllm_names
from minicpm_jax.train.data import frequent_ids

EAGLE_LAYOUTS = ("cpmcu", "vllm")


def _target_head(target: str) -> tuple[np.ndarray, np.ndarray]:
    """(embedding, lm_head) tensors of a target model directory (the embedding twice when tied)."""
    from safetensors import safe_open

    from minicpm_jax.io.safetensors import safetensors_files

    files = safetensors_files(target)
    if "model.embed_tokens.weight" not in files:
        raise MiniCPMError(f"{target!r} has no model.embed_tokens.weight")

    def get(name):
        with safe_open(files[name], framework="flax") as h:
            return np.asarray(h.get_tensor(name))

    embed = get("model.embed_tokens.weight")
    return embed, (get("lm_head.weight") if "lm_head.weight" in files else embed)


def convert_eagle(src: str, dst: str, *, layout: str, target: str | None = None, overwrite: bool = False) -> str:
    """Rewrites the draft at ``src`` (any layout ``load_draft`` reads) with ``layout``'s tensor names:
    ``cpmcu`` (CPM.cu / SafeAILab: ``fc``, ``input_norm1/2``, ``layers.0``; EAGLE-3 ``midlayer``) or
    ``vllm`` (``model.fc``, ``model.eagle_layers.0``, ``model.norm``; MiniCPM EAGLE only, with the
    embedding and lm_head of ``target``). Tensors keep their dtype; ``config.json`` is copied. Returns the
    draft kind."""
    if layout not in EAGLE_LAYOUTS:
        raise MiniCPMError(f"--layout must be one of {', '.join(EAGLE_LAYOUTS)}, got {layout!r}")
    if not os.path.isdir(src):
        raise MiniCPMError(f"draft directory {src!r} does not exist")
    check_destination(dst, overwrite)
    tensors = engine_draft_names(read_draft_tensors(src))
    kind = draft_kind_of(set(tensors))
    if layout == "vllm":
        if kind != "minicpm":
            raise MiniCPMError(f"vLLM's layout is for MiniCPM EAGLE drafts; this one is a {kind} draft")
        if target is None:
            raise MiniCPMError("--layout vllm needs --target (its embedding and lm_head go into the draft)")
        tensors = to_vllm_names(tensors, *_target_head(target))
    with atomic_output_dir(dst, overwrite) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
        config = os.path.join(src, "config.json")
        if os.path.isfile(config):
            shutil.copyfile(config, os.path.join(tmp, "config.json"))
    return kind


def make_frspec(tokenizer_dir: str, corpus: str, vocab_sizes: list[int], dst: str, *, max_lines: int = 1_000_000,
                overwrite: bool = False) -> dict[int, int]:
    """Counts token frequencies over the first ``max_lines`` lines of ``corpus`` (tokenized without
    special tokens) and writes ``freq_{V}.npy`` (int32 ids, most frequent first, ties by id, the EOS ids
    always in: :func:`minicpm_jax.train.data.frequent_ids`) for each V in ``vocab_sizes``, plus ``frspec.json`` describing them. Returns
    {V: distinct tokens seen}."""
    from minicpm_jax.tokenizer import load_tokenizer

    if not vocab_sizes or min(vocab_sizes) < 1:
        raise MiniCPMError("--vocab_sizes needs positive sizes")
    if not os.path.isfile(corpus):
        raise MiniCPMError(f"corpus file {corpus!r} does not exist")
    check_destination(dst, overwrite)
    tok = load_tokenizer(tokenizer_dir)
    vocab = len(tok)
    if max(vocab_sizes) > vocab:
        raise MiniCPMError(f"vocab size {max(vocab_sizes)} exceeds the tokenizer's {vocab} tokens")
    counts = np.zeros(vocab, np.int64)
    lines = 0

    def count(batch):
        ids = [t for x in tok(batch, add_special_tokens=False)["input_ids"] for t in x]
        return np.bincount(np.asarray(ids, np.int64), minlength=vocab)[:vocab]

    with open(corpus, encoding="utf-8", errors="replace") as f:
        batch = []
        for line in f:
            if lines >= max_lines:
                break
            lines += 1
            if line.strip():
                batch.append(line.rstrip("\n"))
            if len(batch) == 1024:
                counts += count(batch)
                batch = []
        if batch:
            counts += count(batch)
    if counts.sum() == 0:
        raise MiniCPMError(f"{corpus!r} has no text to count")
    eos = [t for t in ([tok.eos_token_id] if isinstance(tok.eos_token_id, int) else []) if 0 <= t < vocab]
    seen = {}
    with atomic_output_dir(dst, overwrite) as tmp:
        for v in vocab_sizes:  # by count, ties by id; the draft must be able to propose the end of the text
            np.save(os.path.join(tmp, f"freq_{v}.npy"), frequent_ids(counts, v, keep=eos))
            seen[v] = int(min(v, np.count_nonzero(counts)))
        write_json(os.path.join(tmp, "frspec.json"), {"corpus": os.path.abspath(corpus), "lines": lines,
                                                      "tokens": int(counts.sum()), "vocab_sizes": vocab_sizes,
                                                      "eos_ids": eos})
    return seen


__all__ = ["convert_eagle", "make_frspec"]
