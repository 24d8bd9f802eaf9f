"""Training data for EAGLE drafts: token sequences and the positions whose next-token prediction is trained.

``--data`` is a file or a directory of files (read in sorted name order):

* ``.jsonl``, one record per line, any of:
  ``{"prompt_ids": [...], "answer_ids": [...]}`` — exact token ids (what self-distillation writes,
  :mod:`minicpm_jax.train.distill`); the answer is trained.
  ``{"messages": [{"role": ..., "content": ...}, ...]}`` — a chat through the target's chat template; the
  last assistant turn is trained.
  ``{"text": "..."}`` — plain text; every position is trained.
* ``.txt`` — plain text; documents are separated by blank lines, every position is trained.

A sequence is cut to ``seq_len`` tokens. Position ``t`` is *trained* when ``start <= t < length``: the
draft learns what the target predicts after token ``t`` (for a chat, ``start`` is the last prompt token, so
the first trained prediction is the answer's first token). Batches are a pure function of (seed, step), so
a resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable

import numpy as np

from minicpm_jax.errors import MiniCPMError

DATA_SUFFIXES = (".jsonl", ".txt")
MIN_TOKENS = 3  # one draft input pair and one trained prediction need three tokens


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized training text: ``ids`` and the first trained position ``start``."""

    ids: list[int]
    start: int


@dataclasses.dataclass
class Sequences:
    """Padded training sequences.

    tokens ``int32[N, T]`` (0 past each length); lengths ``int32[N]``; starts ``int32[N]``: the first
    trained position of each row (see the module doc).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def rows(self, idx: np.ndarray) -> "Sequences":
        """The rows ``idx``."""
        return Sequences(self.tokens[idx], self.lengths[idx], self.starts[idx])

    def trained_tokens(self) -> int:
        """How many predictions the data trains (an epoch's worth)."""
        return int(np.sum(np.maximum(self.lengths - self.starts, 0)))

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """``int64[vocab_size]``: how often each id is a trained token (a token after a trained position),
        the frequencies an FR-Spec subset or an EAGLE-3 draft vocabulary is ranked by."""
        t = np.arange(self.seq_len)[None, :]
        trained = (t >= self.starts[:, None] + 1) & (t < self.lengths[:, None])
        return np.bincount(self.tokens[trained].astype(np.int64), minlength=vocab_size)[:vocab_size]


def pack(examples: Iterable[Example], seq_len: int) -> Sequences:
    """Examples cut to ``seq_len`` tokens and padded into :class:`Sequences`; those left with fewer than
    three tokens or nothing trained are dropped. MiniCPMError when nothing is left."""
    kept = []
    for ex in examples:
        ids = ex.ids[:seq_len]
        start = max(ex.start, 0)
        if len(ids) >= MIN_TOKENS and start < len(ids) - 1:
            kept.append((ids, start))
    if not kept:
        raise MiniCPMError(f"the training data has no sequence of at least {MIN_TOKENS} tokens with something "
                           f"to train within --seq_len {seq_len}")
    tokens = np.zeros((len(kept), seq_len), np.int32)
    for i, (ids, _) in enumerate(kept):
        tokens[i, : len(ids)] = ids
    lengths = np.asarray([len(i) for i, _ in kept], np.int32)
    return Sequences(tokens, lengths, np.asarray([s for _, s in kept], np.int32))


def data_files(path: str) -> list[str]:
    """The data files ``path`` names: itself, or the ``.jsonl`` / ``.txt`` files of a directory (sorted)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(DATA_SUFFIXES))
        if not files:
            raise MiniCPMError(f"the data directory {path!r} has no .jsonl or .txt file")
        return files
    if not os.path.isfile(path):
        raise MiniCPMError(f"training data {path!r} does not exist")
    if not path.endswith(DATA_SUFFIXES):
        raise MiniCPMError(f"training data {path!r} must be a .jsonl or .txt file (or a directory of them)")
    return [path]


def _chat_example(tokenizer, messages, where: str) -> Example:
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                       for m in messages)):
        raise MiniCPMError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise MiniCPMError(f"{where}: the chat has no assistant turn to train on")
    if not getattr(tokenizer, "chat_template", None):
        raise MiniCPMError(f"{where}: the target's tokenizer has no chat template for 'messages' records")
    prompt = _ids(tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True, tokenize=True))
    full = _ids(tokenizer.apply_chat_template(messages[: last + 1], tokenize=True))
    if full[: len(prompt)] != prompt:  # a template that renders the history differently: answer text alone
        full = prompt + list(tokenizer(messages[last]["content"], add_special_tokens=False)["input_ids"])
    return Example(full, len(prompt) - 1)


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):  # newer transformers return a BatchEncoding
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def _id_list(value, vocab_size: int, where: str, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise MiniCPMError(f"{where}: {key!r} must be a list of token ids")
    bad = [i for i in value if not 0 <= i < vocab_size]
    if bad:
        raise MiniCPMError(f"{where}: {key!r} has id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return value


def _text_example(tokenizer, text: str) -> Example:
    return Example(list(tokenizer(text, add_special_tokens=True)["input_ids"]), 0)


def read_examples(path: str, tokenizer, vocab_size: int) -> list[Example]:
    """Every example of the data at ``path`` (see the module doc). ``tokenizer`` is needed for text and
    chat records (None: only token-id records are accepted). A bad record raises MiniCPMError naming
    its file and line."""
    out: list[Example] = []
    for file in data_files(path):
        if file.endswith(".txt"):
            if tokenizer is None:
                raise MiniCPMError(f"{file}: text data needs the target's tokenizer")
            with open(file, encoding="utf-8") as f:
                docs = [d.strip() for d in f.read().split("\n\n")]
            out += [_text_example(tokenizer, d) for d in docs if d]
            continue
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{file}:{n}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise MiniCPMError(f"{where}: not a JSON record ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise MiniCPMError(f"{where}: a record must be a JSON object")
                if "prompt_ids" in rec or "answer_ids" in rec:
                    prompt = _id_list(rec.get("prompt_ids"), vocab_size, where, "prompt_ids")
                    answer = _id_list(rec.get("answer_ids"), vocab_size, where, "answer_ids")
                    if not prompt:
                        raise MiniCPMError(f"{where}: 'prompt_ids' is empty")
                    out.append(Example(prompt + answer, len(prompt) - 1))
                    continue
                if "messages" not in rec and not isinstance(rec.get("text"), str):
                    raise MiniCPMError(f"{where}: a record needs prompt_ids/answer_ids, messages or text")
                if tokenizer is None:
                    raise MiniCPMError(f"{where}: text and chat records need the target's tokenizer")
                out.append(_chat_example(tokenizer, rec["messages"], where) if "messages" in rec
                           else _text_example(tokenizer, rec["text"]))
    if not out:
        raise MiniCPMError(f"the training data {path!r} is empty")
    return out


def split_heldout(data: Sequences, fraction: float, seed: int) -> tuple[Sequences, Sequences | None]:
    """(train, held-out): a random ``fraction`` of the rows held out (at least one when > 0, and at least
    one row left to train); ``fraction`` 0 holds nothing out."""
    if not 0.0 <= fraction < 1.0:
        raise MiniCPMError(f"the held-out fraction must be in [0, 1), got {fraction}")
    n = len(data)
    k = 0 if fraction == 0 else min(max(1, round(n * fraction)), n - 1)
    if k == 0:
        return data, None
    perm = np.random.default_rng([seed, 1]).permutation(n)
    return data.rows(np.sort(perm[k:])), data.rows(np.sort(perm[:k]))


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """``int64[batch_size]``: the rows of batch ``step`` — consecutive draws from one seeded permutation per
    epoch (the epochs concatenated), a pure function of its arguments."""
    g = step * batch_size + np.arange(batch_size)
    epoch, pos = g // num_rows, g % num_rows
    out = np.empty(batch_size, np.int64)
    for e in np.unique(epoch):
        perm = np.random.default_rng([seed, 0, int(e)]).permutation(num_rows)
        out[epoch == e] = perm[pos[epoch == e]]
    return out


def frequent_ids(counts: np.ndarray, size: int, keep: Iterable[int] = ()) -> np.ndarray:
    """The ``size`` most frequent ids (ties: lower id first), most frequent first: ``int32[size]`` — an
    FR-Spec subset or an EAGLE-3 draft vocabulary. Ids in ``keep`` (the stop ids: a draft that cannot
    propose the end of an answer loses the last round of every answer) are in it whatever their count,
    taking the places of the least frequent."""
    if not 0 < size <= counts.shape[0]:
        raise MiniCPMError(f"the draft vocabulary size must be in [1, {counts.shape[0]}], got {size}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    keep = [int(k) for k in dict.fromkeys(keep) if 0 <= int(k) < counts.shape[0]][:size]
    kept = set(keep)
    head = [int(i) for i in order if int(i) not in kept][: size - len(keep)]
    chosen = set(head) | set(keep)
    return np.asarray([int(i) for i in order if int(i) in chosen], np.int32)
