"""The contract between an :class:`~minicpm_jax.engine.engine.Engine` and its device programs.

A step set decides what a prompt chunk and a decode block do on the device; the engine decides which
rows run, when, and keeps the host's books. :class:`~minicpm_jax.engine.steps.PlainSteps` (one token a
step) and :class:`~minicpm_jax.engine.speculative.engine.EagleSteps` (EAGLE rounds) satisfy it;
``tests/engine/test_engine.py`` checks both against it, signature by signature.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from minicpm_jax.engine.stops import DecodeState

Cache = Any  # a cache kind of minicpm_jax.model (contiguous KVCache or the paged pool's view)


@runtime_checkable
class StepSet(Protocol):
    """Device programs over ``model`` and one cache of the engine's slots.

    reuse_margin: cached tokens of a reused prefix that must run again (a draft needs the target's
    feature of the last reused position). tokens_per_block: the most tokens a row advances in one decode
    block. has_logprobs: whether first tokens and decode blocks can return log-probabilities. decodes_rows:
    whether a decode block computes only the ``rows`` it is given (else every slot, finished ones masked).
    compile_time: seconds spent compiling so far. page_size: the programs run over a paged cache of pages of
    this size, or over the contiguous cache (None).
    """

    model: Any
    page_size: int | None
    reuse_margin: int
    tokens_per_block: int
    has_logprobs: bool
    decodes_rows: bool

    @property
    def compile_time(self) -> float: ...

    def reset(self, rows: np.ndarray | None = None) -> None:
        """Forgets the programs' own per-row state of every row, or of the rows ``bool[B]``."""

    def truncate(self, lengths: Sequence[int]) -> None:
        """The cache rows were cut to ``lengths``: per-row state past them is dropped."""

    def admitted(self, slot: int, length: int) -> None:
        """A paged engine started ``slot`` (empty) on a prompt whose first ``length`` tokens' pages it shares
        from the prefix cache: per-row state covers them."""

    def prefill_chunk(self, cache: Cache, chunk: Any, logits: jax.Array, mode: str) -> tuple[Cache, jax.Array]:
        """Runs a prompt chunk (``PrefillChunk``) of every row; (cache, last-token logits ``f32[B, V]``)."""

    def prefill_rows(self, cache: Cache, idx: np.ndarray, chunk: Any, mode: str) -> tuple[Cache, jax.Array]:
        """Runs the rows ``idx int32[b]`` of a chunk over their cache rows alone; (cache, logits ``f32[B, V]``)."""

    def first_token(self, cache: Cache, ds: DecodeState, logits: jax.Array, active: jax.Array,
                    sampling: str = "auto", logprobs: int = 0) -> Any:
        """Samples the ``active`` rows' first tokens (and their log-probabilities with ``logprobs`` > 0)."""

    def start(self, ds: DecodeState, rows: jax.Array | None = None) -> None:
        """Decoding begins from ``ds`` for every row, or for the rows ``bool[B]`` joining a running batch."""

    def decode_block(self, cache: Cache, ds: DecodeState, mode: str, sampling: str = "auto",
                     logprobs: int = 0, rows: np.ndarray | None = None) -> tuple:
        """One decode block: (cache, state, tokens ``int32[B, tokens_per_block]``, [log-probabilities]); with
        ``rows`` (distinct slots ``int32[b]``) only those slots are computed, the others keep their state."""

    def accepted(self) -> np.ndarray | None:
        """Speculative rounds of the last decode loop by tokens emitted, summed over rows (None: plain)."""

    def accept_counts(self) -> jax.Array | None:
        """Speculative rounds by tokens emitted since decoding began, a device array (None: plain)."""
