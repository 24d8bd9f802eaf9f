"""An engine's books of a paged KV cache: which pages each slot holds (:class:`~minicpm_jax.engine.pages.PageManager`),
how far each slot's pages reach, and the page table the device sees.

The device never allocates: before a program writes a slot's positions, the host has reserved the pages
they fall in. So each slot keeps ``bound``, the length its pages cover and an upper bound of its length on
the device: set by admission and prefill (exact), raised by one decode block's tokens when a block is
dispatched, and settled down to the exact length when the tokens come back. A row that finishes or is
preempted releases its pages; its full pages stay in the prefix cache for the next prompt that starts
with the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from minicpm_jax.engine.pages import PageManager
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.paged_cache import PagedKVCache

DEFAULT_PAGE_SIZE = 64  # InfLLM-v2's block; a decode step reads whole 64-key blocks anyway


class OutOfPages(MiniCPMError):
    """The KV pool has no free page for a reservation (the scheduler preempts; ``generate`` fails)."""


@dataclasses.dataclass(frozen=True)
class Paging:
    """How an engine's KV memory is paged: ``num_pages`` pages of ``page_size`` tokens (a power of two, at
    least 16: the kernels' smallest key block) shared by every slot, with full pages cached by prefix
    (``prefix_caching``) for later prompts."""

    num_pages: int
    page_size: int = DEFAULT_PAGE_SIZE
    prefix_caching: bool = True

    def __post_init__(self):
        if self.page_size < 16 or self.page_size & (self.page_size - 1):
            raise MiniCPMError(f"the page size must be a power of two >= 16, got {self.page_size}")
        if self.num_pages < 1:
            raise MiniCPMError(f"a paged KV cache needs at least one page, got {self.num_pages}")


class PagedBooks:
    """The host side of one engine's paged cache.

    Args:
      paging: the pool's settings. batch_size: the engine's slots. max_length: the most tokens a slot
        holds (its page-table row covers them). reuse_margin: tokens of a cached prefix a prompt computes
        again (the step set's; :class:`~minicpm_jax.engine.pages.PageManager`).
    """

    def __init__(self, paging: Paging, *, batch_size: int, max_length: int, reuse_margin: int = 0):
        self.paging = paging
        self.page_size = paging.page_size
        self.max_length = max_length
        self.pages = PageManager(paging.num_pages, paging.page_size, batch_size,
                                 PagedKVCache.pages_per_row(max_length, paging.page_size),
                                 prefix_caching=paging.prefix_caching, reuse_margin=reuse_margin)
        self.bound = np.zeros(batch_size, np.int64)  # tokens each slot's pages cover (>= its device length)

    def sync(self, cache: PagedKVCache) -> PagedKVCache:
        """``cache`` with the page table the host holds (uploaded only when it changed)."""
        if not self.pages.dirty:
            return cache
        self.pages.dirty = False
        return cache.with_page_table(self.pages.table)

    def admit(self, slot: int, tokens: Sequence[int]) -> int:
        """Starts ``slot`` (empty) on a prompt: its cached prefix's pages are shared; returns their tokens."""
        cached = self.pages.admit(slot, tokens)
        self.bound[slot] = cached
        return cached

    def cached(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` that :meth:`admit` would find cached now."""
        return self.pages.match(tokens)

    def reserve(self, slot: int, length: int) -> bool:
        """Pages for ``slot``'s positions below ``length`` (capped at ``max_length``); False if the pool
        cannot give them even after evicting cached pages (nothing changes then)."""
        length = min(length, self.max_length)
        if length > self.bound[slot]:
            if not self.pages.reserve(slot, length):
                return False
            self.bound[slot] = length
        return True

    def reserve_many(self, tokens: dict[int, int], ahead: int = 0) -> list[int]:
        """:meth:`reserve` of ``tokens[slot]`` more positions past each slot's bound, at once (a decode step
        over many rows, most of which need no new page); returns the slots that did not get their pages
        (their books unchanged). ``ahead``: a slot that needs a new page takes pages for that many positions
        more while the pool has them (its bound stays where the tokens end), so the page table changes, and
        is sent to the device, every few pages of a row instead of at every page."""
        slots, want, cover = self._growth(tokens)
        grows = want > self.bound[slots]
        short = grows & (want > cover)
        failed = [int(s) for s, w in zip(slots[short], want[short])
                  if not (ahead and self._reserve_free(int(s), min(int(w) + ahead, self.max_length)))
                  and not self.pages.reserve(int(s), int(w))]
        if failed:
            grows &= ~np.isin(slots, failed)
        self.bound[slots[grows]] = want[grows]
        return failed

    def _reserve_free(self, slot: int, length: int) -> bool:
        """:meth:`PageManager.reserve` if free pages cover it (evicting no cached prefix for pages reserved
        ahead); False otherwise, nothing changed."""
        need = self.pages_for(length) - self.pages.slot_capacity(slot) // self.page_size
        return need <= self.pages.free_pages and self.pages.reserve(slot, length)

    def pages_needed(self, tokens: dict[int, int]) -> int:
        """New pages that ``tokens[slot]`` more positions past each slot's bound take (what
        :meth:`reserve_many` without ``ahead`` would take from the pool)."""
        _, want, cover = self._growth(tokens)
        return int(np.maximum(0, -(-want // self.page_size) - cover // self.page_size).sum())

    def _growth(self, tokens: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ``tokens[slot]`` more positions past each slot's bound: (the slots, the positions each then
        needs covered (at most ``max_length``), the positions its pages cover now), as ``int64`` arrays."""
        slots = np.fromiter(tokens.keys(), np.int64, len(tokens))
        more = np.fromiter(tokens.values(), np.int64, len(tokens))
        want = np.minimum(self.bound[slots] + more, self.max_length)
        return slots, want, self.pages.capacities(slots)

    def settle(self, slot: int, length: int) -> None:
        """``slot``'s device length is at most ``length`` now (tokens came back): later growth starts there
        (pages already reserved past it stay the slot's)."""
        self.bound[slot] = min(self.bound[slot], max(length, 0))

    def publish(self, slot: int, tokens: Sequence[int]) -> None:
        """``tokens`` (from position 0) are in ``slot``'s pages: their full pages enter the prefix cache."""
        self.pages.publish(slot, tokens)

    def release(self, slot: int, tokens: Sequence[int] | None = None) -> None:
        """Ends ``slot``'s sequence (publishing ``tokens`` first, when given); its pages go back to the pool
        or stay cached."""
        self.pages.release(slot, tokens)
        self.bound[slot] = 0

    def truncate(self, slot: int, length: int) -> int:
        """Cuts ``slot``'s sequence to ``length`` tokens (less when that would write a shared page); returns
        the length kept."""
        kept = self.pages.truncate(slot, length)
        self.bound[slot] = kept
        return kept

    def available(self) -> int:
        """Pages a reservation could get now (free, or cached and unused)."""
        return self.pages.available()

    def pages_for(self, tokens: int) -> int:
        """Pages ``tokens`` positions take."""
        return -(-tokens // self.page_size)

    def stats(self) -> dict:
        return self.pages.stats()
