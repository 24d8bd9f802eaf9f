"""Host-side bookkeeping of the paged KV cache: page allocation, the page tables and the radix prefix cache.

The device holds one pool of ``num_pages`` pages of ``page_size`` tokens each (the K/V of every layer; a
draft model's pool, if any, is indexed by the same page ids). Each of the engine's ``num_slots`` sequence
slots (the rows of the static batch) has a row of :attr:`PageManager.table`, ``int32[num_slots, max_pages]``:
position ``t`` of the slot's sequence lives at offset ``t % page_size`` of page ``table[slot, t // page_size]``.
This module decides which page is where; it never touches device memory. The engine uploads ``table``
when :attr:`PageManager.dirty` says it changed.

Prefix caching (SGLang's RadixAttention, at page granularity as in vLLM): a full page whose KV is known
(:meth:`PageManager.publish`) enters a radix tree of pages, one node per page, keyed by the page's tokens
under its parent (the pages before it). A later prompt that starts with the same tokens takes references
on those pages instead of computing them again (:meth:`PageManager.admit`). Only full pages are cached or
shared, and a slot only writes positions at or past its cached prefix, so a shared page is never written.

A page is referenced by each slot whose row holds it and by the tree if it is cached there; it is free
when nothing references it. A cached page no slot uses stays cached until a reservation needs its memory:
eviction takes the least recently used leaf of the tree first (a page is only evicted after the pages
cached below it), from a heap of the evictable leaves, so an eviction costs O(log n), not a sort.

Only the scheduler thread mutates a :class:`PageManager`; :meth:`PageManager.stats` may be read from
other threads (plain numbers, possibly a step old).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from minicpm_jax.errors import MiniCPMError


class _Node:
    """A cached page in the radix tree: the KV of the ``page_size`` tokens ``key`` that follow the tokens of
    the pages on the path from the root to ``parent``.

    ``lock``: how many slots pin this node, i.e. reference this page or a page cached below it (a node with
    ``lock == 0`` can be evicted once its subtree is). ``used``: the clock of its last use (LRU).
    ``page == -1`` once evicted."""

    __slots__ = ("page", "key", "parent", "children", "depth", "lock", "used", "serial")

    def __init__(self, page: int, key: tuple[int, ...], parent: _Node | None, used: int, serial: int):
        self.page, self.key, self.parent = page, key, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root, this one included
        self.lock, self.used, self.serial = 0, used, serial


def _require(ok: bool, message: str) -> None:
    """An invariant of :meth:`PageManager.check` (an ``AssertionError`` that survives ``python -O``)."""
    if not ok:
        raise AssertionError(message)


def _ints(tokens: Sequence[int] | np.ndarray) -> Sequence[int]:
    """Token ids as a sliceable sequence of Python ints (arrays converted once, so keys hash fast)."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else tokens


class PageManager:
    """Allocates the KV pool's pages to the engine's slots and caches full pages by prefix.

    Args:
      num_pages: pages in the device pool.
      page_size: tokens per page, a power of two.
      num_slots: sequence slots (rows of the static batch), each with a page-table row.
      max_pages: entries of a page-table row: ``ceil(max_length / page_size)``.
      prefix_caching: cache published pages for later prompts; off, :meth:`match` and :meth:`admit` find
        nothing and :meth:`publish` does nothing.
      scratch_page: keep page 0 out of allocation. Unused table entries are 0, so with it a write the
        device makes through an unused entry (an inactive row of the static batch, padding) lands in a page
        nobody reads; without it, page 0 is an ordinary page and such writes must be masked on device.
      on_evict: called as ``on_evict(page, tokens)`` when a cached page is evicted, with the tokens of its
        whole prefix (the page's own tokens last); for tests and host-side caches of evicted pages.
      reuse_margin: tokens at the end of a cached prefix a new prompt computes again: it shares only the
        whole pages before them (a speculative engine's draft stores the pair of a page's last position
        with the token after it, which the new prompt may not share).

    Raises:
      MiniCPMError: a size is not valid.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages: int, *,
                 prefix_caching: bool = True, scratch_page: bool = False,
                 on_evict: Callable[[int, tuple[int, ...]], None] | None = None, reuse_margin: int = 0):
        first = 1 if scratch_page else 0
        if page_size < 1 or page_size & (page_size - 1):
            raise MiniCPMError(f"the page size must be a power of two, got {page_size}")
        if num_pages <= first or num_slots < 1 or max_pages < 1:
            raise MiniCPMError(f"a paged KV cache needs at least {first + 1} page(s), one slot and one page per "
                               f"slot; got num_pages={num_pages}, num_slots={num_slots}, max_pages={max_pages}")
        if num_pages > np.iinfo(np.int32).max:
            raise MiniCPMError(f"{num_pages} pages do not fit the int32 page table")
        self.num_pages, self.page_size, self.num_slots, self.max_pages = num_pages, page_size, num_slots, max_pages
        self.prefix_caching, self.scratch_page, self.on_evict = prefix_caching, scratch_page, on_evict
        self.reuse_margin = reuse_margin
        self.table = np.zeros((num_slots, max_pages), np.int32)
        self.dirty_rows: set[int] = set()  # rows of ``table`` changed since the engine last uploaded it
        self._first = first  # lowest allocatable page
        self._free = list(range(first, num_pages))  # a heap (sorted is one): lowest index first
        self._refs = [0] * num_pages  # slots holding the page + 1 if it is cached
        self._pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._root = _Node(-1, (), None, 0, 0)
        self._pinned = [self._root] * num_slots  # each slot's deepest cached node whose page it holds
        self._cached: dict[int, _Node] = {}  # page -> its node
        self._leaves: list[tuple[int, int, _Node]] = []  # (used, serial, node) heap of evictable leaves, lazy
        self._unlocked = 0  # cached nodes no slot pins: evictable (their subtrees first)
        self._idle = 0  # cached pages no slot holds
        self._clock = 0  # ticks once per admit / publish: the LRU time
        self._serial = 0  # node creation count: breaks LRU ties deterministically
        self.prefix_queries = 0  # prompt tokens asked for in admit
        self.prefix_hits = 0  # of them, tokens served from the cache
        self.evictions = 0  # cached pages evicted
        self.peak_used = 0  # the most pages slots held at once (a reservation's high-water mark)

    # ------------------------------------------------------------------ queries
    @property
    def dirty(self) -> bool:
        """Whether ``table`` changed since the flag was last cleared; ``dirty = False`` clears it (and
        :attr:`dirty_rows`), ``dirty = True`` marks every row."""
        return bool(self.dirty_rows)

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self.dirty_rows = set(range(self.num_slots)) if value else set()

    def take_dirty_rows(self) -> list[int]:
        """The rows of ``table`` changed since the last call (ascending), and clears :attr:`dirty`."""
        rows, self.dirty_rows = sorted(self.dirty_rows), set()
        return rows

    def slot_pages(self, slot: int) -> list[int]:
        """The pages of ``slot``'s sequence, in order (a copy)."""
        self._check_slot(slot)
        return list(self._pages[slot])

    def slot_capacity(self, slot: int) -> int:
        """Tokens ``slot``'s pages cover: ``len(slot_pages(slot)) * page_size``."""
        self._check_slot(slot)
        return len(self._pages[slot]) * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages neither held nor cached (a reservation takes them before evicting cached ones)."""
        return len(self._free)

    def capacities(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """:meth:`slot_capacity` of each of ``slots`` (``int64[len(slots)]``; one pass, for a decode step's
        rows)."""
        return np.fromiter((len(self._pages[s]) for s in slots), np.int64, len(slots)) * self.page_size

    def refcount(self, page: int) -> int:
        """References to ``page``: the slots holding it, plus one if it is cached."""
        return self._refs[page]

    def available(self) -> int:
        """Pages a reservation could get now: the free ones plus the cached ones no slot needs."""
        return len(self._free) + self._unlocked

    def match(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``tokens`` the cache holds as whole pages, leaving at least one token
        to compute: a multiple of ``page_size``, at most ``len(tokens) - 1`` (a fully cached prompt has
        its last page computed again, for the logits of its last token). Changes nothing."""
        if not self.prefix_caching:
            return 0
        tokens = _ints(tokens)
        return len(self._shared_path(tokens)) * self.page_size

    def stats(self) -> dict[str, int | float]:
        """Counters, safe to read from any thread: ``pages_total`` (allocatable), ``pages_free``,
        ``pages_cached`` (held by the prefix cache alone), ``pages_evictable`` (of those, the ones not under
        a page a slot holds), ``pages_used`` (held by a slot), ``pages_used_peak`` (the most held at once since
        the start), ``page_size``, ``prefix_queries`` /
        ``prefix_hits`` (prompt tokens asked for / served by :meth:`admit`), ``hit_rate``, ``evictions``."""
        total, free, idle = self.num_pages - self._first, len(self._free), self._idle
        queries, hits = self.prefix_queries, self.prefix_hits
        return {"pages_total": total, "pages_free": free, "pages_cached": idle, "pages_evictable": self._unlocked,
                "pages_used": max(0, total - free - idle), "pages_used_peak": self.peak_used,
                "page_size": self.page_size,
                "prefix_queries": queries, "prefix_hits": hits, "hit_rate": hits / queries if queries else 0.0,
                "evictions": self.evictions}

    # ------------------------------------------------------------------ slot operations
    def admit(self, slot: int, tokens: Sequence[int] | np.ndarray) -> int:
        """Starts ``slot`` (which must hold no page) on a prompt: takes a reference on each cached page of
        the prompt's longest cached prefix (as :meth:`match` counts it), puts them in the slot's table row
        and marks them used. Returns the cached token count; the engine computes the rest after
        :meth:`reserve`. Always 0 with prefix caching off."""
        self._check_slot(slot)
        if self._pages[slot]:
            raise ValueError(f"slot {slot} still holds pages: release it before admitting a new prompt")
        tokens = _ints(tokens)
        self.prefix_queries += len(tokens)
        if not self.prefix_caching:
            return 0
        path = self._shared_path(tokens)
        if not path:
            return 0
        self._clock += 1
        pages = self._pages[slot]
        for node in path:
            node.used = self._clock
            self._take(node.page)
            pages.append(node.page)
        self._pin(slot, path[-1])
        self.table[slot, :len(pages)] = pages
        self.dirty_rows.add(slot)
        cached = len(pages) * self.page_size
        self.prefix_hits += cached
        self._note_peak()
        return cached

    def reserve(self, slot: int, length: int) -> bool:
        """Makes ``slot``'s pages cover positions ``[0, length)``, appending new private pages (lowest free
        index first). All or nothing: if the free pages do not suffice, unused cached pages are evicted
        (least recently used leaves first); if even that is not enough, nothing changes and it returns
        False (the scheduler then waits or preempts). A slot never shrinks here (see :meth:`truncate`).

        Raises:
          MiniCPMError: ``length`` exceeds the table row (``max_pages * page_size`` tokens).
        """
        self._check_slot(slot)
        if not 0 <= length <= self.max_pages * self.page_size:
            raise MiniCPMError(f"{length} tokens do not fit a slot of {self.max_pages} pages of "
                               f"{self.page_size} tokens ({self.max_pages * self.page_size} tokens)")
        pages = self._pages[slot]
        need = -(-length // self.page_size) - len(pages)
        if need <= 0:
            return True
        if need > self.available():
            return False
        if need > len(self._free):
            self._evict(need - len(self._free))
        new = [heapq.heappop(self._free) for _ in range(need)]
        for page in new:
            self._refs[page] = 1
        self.table[slot, len(pages):len(pages) + need] = new
        pages.extend(new)
        self.dirty_rows.add(slot)
        self._note_peak()
        return True

    def publish(self, slot: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Caches the full pages of ``slot`` whose KV is known: ``tokens`` are the ids at positions
        ``0 .. len(tokens)-1`` of the slot's sequence, all computed. Each full page among them enters the
        tree under the pages before it. Where the tree already holds a page for the same tokens (another
        slot computed the same prefix meanwhile) the cached page stays and the slot keeps its own copy,
        uncached (freed on release). Publishing again, or a shorter prefix, changes nothing but the pages'
        last use; a longer one adds only the new full pages. Nothing with prefix caching off.

        Raises:
          ValueError: ``tokens`` are longer than the slot's pages, or disagree with the tokens of a cached
            page the slot holds (they are not the slot's sequence).
        """
        self._check_slot(slot)
        if not self.prefix_caching:
            return
        tokens, pages, size = _ints(tokens), self._pages[slot], self.page_size
        if len(tokens) > len(pages) * size:
            raise ValueError(f"{len(tokens)} tokens published but slot {slot}'s pages hold {len(pages) * size}")
        keys = [tuple(tokens[i:i + size]) for i in range(0, len(tokens) - size + 1, size)]
        if not keys:
            return
        # The slot's cached pages all lie on the chain of its pinned node: the tokens must follow it.
        chain = self._chain(self._pinned[slot])
        path, node = [], self._root
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        agree = min(len(chain), len(keys))
        if path[:agree] != chain[:agree]:
            raise ValueError(f"the tokens published for slot {slot} disagree with the cached pages it holds")
        for i in range(len(path), len(keys)):  # pages past the chain are the slot's private ones
            path.append(self._new_node(path[-1] if path else self._root, keys[i], pages[i]))
        self._clock += 1
        for node in path:
            node.used = self._clock
        deepest = next((n for n, page in zip(path[::-1], pages[len(path) - 1::-1]) if n.page == page), None)
        if deepest is not None and deepest.depth > self._pinned[slot].depth:
            self._pin(slot, deepest)
        last = path[-1]
        if last.lock == 0 and not last.children:  # a duplicate leaf the slot does not hold: its use changed
            self._push(last)

    def release(self, slot: int, tokens: Sequence[int] | np.ndarray | None = None) -> None:
        """Ends ``slot``'s sequence: :meth:`publish` ``tokens`` first if given, then drops the slot's
        references to all its pages (unreferenced uncached pages become free; cached ones stay cached,
        evictable) and clears its table row."""
        self._check_slot(slot)
        if tokens is not None:
            self.publish(slot, tokens)
        self._pin(slot, self._root)
        for page in self._pages[slot]:
            self._drop(page)
        if self._pages[slot]:
            self._pages[slot] = []
            self.table[slot] = 0
            self.dirty_rows.add(slot)

    def truncate(self, slot: int, length: int) -> int:
        """Cuts ``slot``'s sequence to its first ``length`` tokens: the pages wholly past them are dropped.
        Returns the length kept: ``length``, or ``length`` rounded down to a page boundary when the page
        it ends in is cached (the slot would write that page's tail, and a shared page is never written:
        the engine recomputes from the returned length instead).

        Raises:
          ValueError: ``length`` is negative or past the slot's capacity.
        """
        self._check_slot(slot)
        pages, size = self._pages[slot], self.page_size
        if not 0 <= length <= len(pages) * size:
            raise ValueError(f"cannot truncate slot {slot} to {length} tokens: it holds {len(pages) * size}")
        keep = -(-length // size)
        if length % size and pages[keep - 1] in self._cached:
            keep -= 1
            length = keep * size
        if keep == len(pages):
            return length
        node = self._pinned[slot]  # the deepest cached page still held: up the chain from the old one
        while node is not self._root and (node.depth > keep or node.page != pages[node.depth - 1]):
            node = node.parent
        self._pin(slot, node)
        for page in pages[keep:]:
            self._drop(page)
        del pages[keep:]
        self.table[slot, keep:] = 0
        self.dirty_rows.add(slot)
        return length

    def evict(self, count: int | None = None) -> int:
        """Evicts up to ``count`` cached pages no slot needs (all of them if None), least recently used
        leaves first; returns how many were evicted."""
        count = self._unlocked if count is None else max(0, min(count, self._unlocked))
        self._evict(count)
        return count

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raises AssertionError unless every invariant holds: reference counts equal the references from
        slots and the tree; a page is free iff nothing references it; table rows equal the slots' page
        lists (unused entries 0); pages are shared between slots only if cached; every cached node has a
        valid page, a live parent chain and a correct pin count; the counters match; every evictable leaf
        is in the eviction heap. O(pages + nodes + slots * max_pages): for tests."""
        first, refs = self._first, [0] * self.num_pages
        for slot, pages in enumerate(self._pages):
            _require(len(pages) <= self.max_pages and len(set(pages)) == len(pages), f"slot {slot}: pages {pages}")
            _require(all(first <= p < self.num_pages for p in pages), f"slot {slot}: invalid page in {pages}")
            row = self.table[slot].tolist()
            _require(row == pages + [0] * (self.max_pages - len(pages)), f"slot {slot}: table {row} != {pages}")
            for p in pages:
                refs[p] += 1
        nodes, stack = [], [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                _require(child.parent is node and child.key == key and len(key) == self.page_size
                         and child.depth == node.depth + 1, f"node of page {child.page}: broken link")
                _require(first <= child.page < self.num_pages and self._cached.get(child.page) is child,
                         f"node of page {child.page}: not in the page map")
                nodes.append(child)
                stack.append(child)
        _require(self.prefix_caching or not nodes, "pages cached with prefix caching off")
        _require(len(nodes) == len(self._cached), "page map holds nodes outside the tree")
        slot_refs = list(refs)
        for node in nodes:
            refs[node.page] += 1
        _require(refs == self._refs, "reference counts differ from the references")
        _require(sorted(self._free) == [p for p in range(first, self.num_pages) if refs[p] == 0],
                 "the free list differs from the unreferenced pages")
        _require(all(slot_refs[p] <= 1 or p in self._cached for p in range(self.num_pages)),
                 "an uncached page is shared between slots")
        locks = {id(n): 0 for n in nodes}
        for slot, pages in enumerate(self._pages):
            held = [self._cached[p] for p in pages if p in self._cached]
            pinned = self._pinned[slot]
            _require(pinned is (max(held, key=lambda n: n.depth) if held else self._root),
                     f"slot {slot}: pinned node is not its deepest cached page")
            chain = self._chain(pinned)
            _require(all(any(n is c for c in chain) for n in held), f"slot {slot}: holds cached pages off its chain")
            for n in chain:
                locks[id(n)] += 1
        _require(all(n.lock == locks[id(n)] for n in nodes), "pin counts differ from the slots' chains")
        _require(all(n.lock or refs[n.page] == 1 for n in nodes), "an unpinned cached page is held by a slot")
        _require(self._unlocked == sum(n.lock == 0 for n in nodes), "evictable count is wrong")
        _require(self._idle == sum(refs[n.page] == 1 for n in nodes), "cached-only count is wrong")
        valid = {id(n) for used, _, n in self._leaves if n.page >= 0 and used == n.used}
        _require(all(id(n) in valid for n in nodes if n.lock == 0 and not n.children),
                 "an evictable leaf is missing from the eviction heap")

    # ------------------------------------------------------------------ internals
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    def _shared_path(self, tokens: list[int]) -> list[_Node]:
        """The cached pages a prompt shares: its longest cached prefix of whole pages leaving a token to
        compute, less the pages that hold its last ``reuse_margin`` tokens."""
        path = self._walk(tokens, len(tokens) - 1)
        return path[: max(0, len(path) * self.page_size - self.reuse_margin) // self.page_size]

    def _walk(self, tokens: Sequence[int], limit: int) -> list[_Node]:
        """The cached nodes of the whole pages of ``tokens[:limit]``, from the root, as far as cached."""
        size, node, path = self.page_size, self._root, []
        for start in range(0, limit - size + 1, size):
            node = node.children.get(tuple(tokens[start:start + size]))
            if node is None:
                break
            path.append(node)
        return path

    def _chain(self, node: _Node) -> list[_Node]:
        """The nodes from depth 1 down to ``node`` (empty for the root)."""
        chain = []
        while node is not self._root:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_pages - self._first - len(self._free) - self._idle)

    def _take(self, page: int) -> None:
        """One more slot reference on ``page``."""
        self._refs[page] += 1
        if self._refs[page] == 2 and page in self._cached:
            self._idle -= 1

    def _drop(self, page: int) -> None:
        """One slot reference less on ``page``: freed at zero."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            heapq.heappush(self._free, page)
        elif self._refs[page] == 1 and page in self._cached:
            self._idle += 1

    def _new_node(self, parent: _Node, key: tuple[int, ...], page: int) -> _Node:
        """Caches ``page`` (held by the slot publishing it) under ``parent``; the caller pins it."""
        self._serial += 1
        node = _Node(page, key, parent, self._clock, self._serial)
        parent.children[key] = node
        self._cached[page] = node
        self._refs[page] += 1
        self._unlocked += 1
        return node

    def _pin(self, slot: int, node: _Node) -> None:
        """Moves ``slot``'s pin to ``node``: every node from ``node`` up is pinned once more, then every node
        from the old one up once less (in that order, so shared ancestors never drop to zero). O(depth)."""
        old = self._pinned[slot]
        if node is old:
            return
        self._pinned[slot] = node
        while node is not self._root:
            node.lock += 1
            if node.lock == 1:
                self._unlocked -= 1
            node = node.parent
        while old is not self._root:
            old.lock -= 1
            if old.lock == 0:
                self._unlocked += 1
                if not old.children:
                    self._push(old)
            old = old.parent

    def _push(self, node: _Node) -> None:
        """Enters an evictable leaf in the heap. Entries go stale (the node was evicted, pinned, given a
        child or used again) and are skipped when popped; the heap is rebuilt when stale ones dominate."""
        if len(self._leaves) > 2 * len(self._cached) + 64:
            self._leaves = [(n.used, n.serial, n) for n in self._cached.values() if n.lock == 0 and not n.children]
            heapq.heapify(self._leaves)
        heapq.heappush(self._leaves, (node.used, node.serial, node))

    def _evict(self, count: int) -> None:
        """Evicts ``count`` unpinned cached pages, least recently used leaf first (the caller checked that
        ``count <= self._unlocked``: the leaves of unpinned subtrees are all in the heap, their parents
        enter it as they become leaves). O(count * log heap)."""
        for _ in range(count):
            while True:
                used, _, node = heapq.heappop(self._leaves)
                if node.page >= 0 and node.lock == 0 and not node.children and used == node.used:
                    break
            if self.on_evict is not None:
                tokens = [t for n in self._chain(node) for t in n.key]
                self.on_evict(node.page, tuple(tokens))
            parent = node.parent
            del parent.children[node.key]
            del self._cached[node.page]
            self._refs[node.page] = 0
            heapq.heappush(self._free, node.page)
            node.page = -1
            self._unlocked -= 1
            self._idle -= 1
            self.evictions += 1
            if parent is not self._root and not parent.children:
                self._push(parent)
