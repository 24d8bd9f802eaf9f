"""The paged KV cache's host bookkeeping: allocation, sharing through the radix prefix cache, LRU eviction
(leaves first), all-or-nothing reservations, truncation, publishing, counters, and a randomized run that
simulates the device pool's contents and checks every invariant and a brute-force prefix oracle."""

from __future__ import annotations

import numpy as np
import pytest

from minicpm_jax.engine.pages import PageManager
from minicpm_jax.errors import MiniCPMError

P = 4  # page size of these tests


def _manager(num_pages=16, num_slots=3, max_pages=6, **kw) -> PageManager:
    return PageManager(num_pages, P, num_slots, max_pages, **kw)


def _prefill(pm: PageManager, slot: int, tokens: list[int]) -> int:
    """Admits ``tokens`` into ``slot`` and reserves them: the cached token count."""
    cached = pm.admit(slot, tokens)
    assert pm.reserve(slot, len(tokens))
    pm.check()
    return cached


def test_bad_arguments_raise():
    for args in [(0, P, 1, 1), (8, 3, 1, 1), (8, 0, 1, 1), (8, P, 0, 1), (8, P, 1, 0)]:
        with pytest.raises(MiniCPMError):
            PageManager(*args)
    with pytest.raises(MiniCPMError):
        PageManager(1, P, 1, 1, scratch_page=True)
    pm = _manager(max_pages=2)
    with pytest.raises(MiniCPMError, match="do not fit"):
        pm.reserve(0, 2 * P + 1)
    with pytest.raises(ValueError):
        pm.reserve(3, 1)
    assert pm.reserve(0, 1)
    with pytest.raises(ValueError, match="still holds pages"):
        pm.admit(0, [1, 2])


def test_allocation_and_release_round_trip():
    pm = _manager()
    assert not pm.dirty and pm.available() == 16
    assert pm.reserve(0, 2 * P + 1) and pm.reserve(1, P)
    pm.check()
    assert pm.slot_pages(0) == [0, 1, 2] and pm.slot_pages(1) == [3]  # lowest free index first
    assert pm.slot_capacity(0) == 3 * P and pm.table[0, :4].tolist() == [0, 1, 2, 0]
    assert pm.take_dirty_rows() == [0, 1] and not pm.dirty
    assert pm.reserve(0, 3 * P) and not pm.dirty  # already covered: nothing changes
    assert pm.reserve(0, 3 * P + 1) and pm.slot_pages(0) == [0, 1, 2, 4] and pm.dirty_rows == {0}
    pm.release(0)
    pm.check()
    assert pm.slot_pages(0) == [] and not pm.table[0].any() and pm.available() == 15
    assert pm.reserve(2, 5 * P) and pm.slot_pages(2) == [0, 1, 2, 4, 5]  # freed pages come back first
    pm.release(1)
    pm.release(2)
    pm.check()
    assert pm.stats()["pages_free"] == 16 and pm.stats()["pages_used"] == 0
    pm.dirty = False
    assert not pm.dirty_rows
    pm.dirty = True
    assert pm.take_dirty_rows() == [0, 1, 2]


def test_two_slots_share_a_published_prefix():
    pm = _manager()
    prompt = list(range(100, 100 + 3 * P + 2))  # three full pages and two tokens
    assert _prefill(pm, 0, prompt) == 0
    pm.publish(0, prompt)
    pm.check()
    shared = pm.slot_pages(0)[:3]
    assert [pm.refcount(p) for p in pm.slot_pages(0)] == [2, 2, 2, 1]  # slot + cache; the partial page is private
    assert pm.match(prompt + [7]) == 3 * P
    assert _prefill(pm, 1, prompt + [7]) == 3 * P
    assert pm.slot_pages(1)[:3] == shared and pm.slot_pages(1)[3] not in pm.slot_pages(0)
    assert [pm.refcount(p) for p in shared] == [3, 3, 3]
    pm.release(0)
    pm.check()
    assert [pm.refcount(p) for p in shared] == [2, 2, 2]
    pm.release(1)
    pm.check()
    s = pm.stats()
    assert s["pages_cached"] == 3 and s["pages_evictable"] == 3 and s["pages_free"] == 13 and s["pages_used"] == 0
    assert s["pages_used_peak"] == 5  # 3 shared + a private last page each, held at once


def test_a_whole_cached_prompt_leaves_its_last_page_to_compute():
    pm = _manager()
    prompt = list(range(2 * P))
    _prefill(pm, 0, prompt)
    pm.release(0, prompt)
    assert pm.match(prompt) == P  # both pages cached, the last one is recomputed
    assert pm.match(prompt + [1]) == 2 * P
    assert pm.match(prompt[:P + 1]) == P and pm.match(prompt[:P]) == 0 and pm.match([]) == 0
    assert pm.match([9] + prompt) == 0
    assert pm.admit(0, prompt) == P and pm.slot_capacity(0) == P
    assert pm.reserve(0, 2 * P)
    pm.check()
    pm.publish(0, prompt)  # the recomputed page duplicates the cached one: the cached one stays
    pm.check()
    assert pm.refcount(pm.slot_pages(0)[1]) == 1 and pm.match(prompt + [1]) == 2 * P


@pytest.mark.parametrize("margin,shared", [(1, 2), (P, 2), (P + 1, 1)])
def test_a_reuse_margin_holds_back_the_pages_of_the_prefixs_last_tokens(margin, shared):
    """A speculative engine's margin (tokens of a cached prefix computed again): a prompt shares only the
    whole pages before them, in match and admit alike; the hit counter counts what was shared."""
    pm = _manager(reuse_margin=margin)
    prompt = list(range(3 * P + 1))
    _prefill(pm, 0, prompt)
    pm.release(0, prompt)
    assert pm.match(prompt + [5]) == shared * P
    assert pm.admit(1, prompt + [5]) == shared * P and pm.slot_pages(1) == pm.slot_pages(1)[:shared]
    assert pm.stats()["prefix_hits"] == shared * P
    pm.check()


def test_eviction_is_lru_and_takes_leaves_first():
    evicted = []
    pm = _manager(num_pages=8, num_slots=2, max_pages=8, on_evict=lambda page, tokens: evicted.append(tokens[0]))
    x = [1] * (3 * P)  # one chain of three pages, published in one go: all used at the same time
    y = [2] * P
    for prompt in (x, y):
        _prefill(pm, 0, prompt)
        pm.release(0, prompt)
    pm.admit(0, x[:P] + [0])  # uses x's first page again, after y
    pm.release(0)
    pm.check()
    assert pm.available() == 8 and pm.stats()["pages_free"] == 4
    # x's leaves go first although x's first page was used last; then y (older than x[0]), then x[0].
    for i, expected in enumerate([1, 1, 2, 1]):
        assert pm.reserve(1, (5 + i) * P)
        pm.check()
        assert evicted == [1, 1, 2, 1][:i + 1] and evicted[-1] == expected
    assert pm.match(x + [0]) == 0 and pm.stats()["evictions"] == 4


def test_eviction_order_within_a_chain_and_public_evict():
    order = []
    pm = _manager(on_evict=lambda page, tokens: order.append(len(tokens)))
    prompt = list(range(4 * P))
    _prefill(pm, 0, prompt)
    pm.release(0, prompt)
    assert pm.evict(2) == 2 and order == [4 * P, 3 * P]  # deepest first
    pm.check()
    assert pm.match(prompt) == 2 * P
    assert pm.evict() == 2 and order == [4 * P, 3 * P, 2 * P, P] and pm.evict() == 0
    pm.check()
    assert pm.stats()["pages_free"] == 16


def test_many_reuses_of_one_prefix_keep_eviction_right():
    """Each release re-enters the leaf in the eviction heap (the old entry goes stale): the heap is
    rebuilt as stale entries pile up, and eviction still finds the right pages."""
    order = []
    pm = _manager(on_evict=lambda page, tokens: order.append(tokens[0]))
    a, b = [1] * (2 * P), [2] * (2 * P)
    for prompt in (a, b):
        _prefill(pm, 0, prompt)
        pm.release(0, prompt)
    for _ in range(200):
        pm.admit(0, a + [0])
        pm.release(0)
    pm.check()
    assert pm.evict(3) == 3 and order == [2, 2, 1]
    pm.check()


def test_reserve_is_all_or_nothing_and_never_evicts_what_a_slot_holds():
    pm = _manager(num_pages=6, num_slots=2, max_pages=6)
    a = list(range(3 * P))
    _prefill(pm, 0, a)
    pm.publish(0, a)  # cached but still held by slot 0: not evictable
    assert pm.available() == 3
    assert not pm.reserve(1, 4 * P)
    pm.check()
    assert pm.slot_pages(1) == [] and pm.stats()["evictions"] == 0 and not pm.dirty_rows - {0}
    assert pm.reserve(1, 3 * P) and pm.available() == 0
    assert not pm.reserve(1, 3 * P + 1) and pm.slot_capacity(1) == 3 * P
    pm.release(1)
    pm.release(0)
    assert pm.available() == 6 and pm.reserve(1, 6 * P) and pm.stats()["evictions"] == 3
    pm.check()


def test_truncate_drops_whole_pages_and_never_keeps_a_cached_page_partly():
    pm = _manager()
    prompt = list(range(3 * P))
    _prefill(pm, 0, prompt + [5])
    pages = pm.slot_pages(0)
    assert pm.truncate(0, 3 * P + 1) == 3 * P + 1 and pm.slot_pages(0) == pages  # nothing wholly past
    assert pm.truncate(0, 2 * P + 1) == 2 * P + 1  # private pages: cut inside a page
    pm.check()
    assert pm.slot_pages(0) == pages[:3] and pm.stats()["pages_free"] == 13
    pm.release(0, prompt[:2 * P + 1])
    pm.admit(1, prompt[:2 * P] + [9])
    assert pm.reserve(1, 3 * P)
    held = pm.slot_pages(1)
    assert pm.truncate(1, P + 2) == P  # page 1 is cached: kept only up to its start
    pm.check()
    assert pm.slot_pages(1) == held[:1] and pm.refcount(held[1]) == 1  # the cache's reference alone
    assert pm.truncate(1, 0) == 0 and pm.slot_pages(1) == [] and not pm.table[1].any()
    pm.check()
    with pytest.raises(ValueError):
        pm.truncate(1, 1)
    assert pm.stats()["pages_cached"] == 2 and pm.stats()["pages_used"] == 0


def test_publish_is_idempotent_and_keeps_the_first_copy_of_a_duplicate():
    pm = _manager()
    prompt = list(range(50, 50 + 2 * P + 1))
    _prefill(pm, 0, prompt)
    _prefill(pm, 1, prompt)  # computed concurrently: nothing cached yet
    pm.publish(0, prompt[:P])
    pm.check()
    before = pm.stats()
    pm.publish(0, prompt[:P])
    pm.publish(0, prompt[:P + 3])  # no new full page
    pm.check()
    assert pm.stats() == before and pm.stats()["pages_cached"] == 0
    pm.publish(0, prompt)  # adds the second page only
    pm.check()
    first = pm.slot_pages(0)
    assert [pm.refcount(p) for p in first] == [2, 2, 1]
    pm.publish(1, prompt)  # same tokens in other pages: the cached pages stay
    pm.check()
    assert [pm.refcount(p) for p in pm.slot_pages(1)] == [1, 1, 1]
    pm.release(1, prompt)
    pm.check()
    assert pm.stats()["pages_free"] == 16 - 3 and pm.match(prompt) == 2 * P
    with pytest.raises(ValueError, match="disagree"):
        pm.publish(0, [0] * (2 * P))
    with pytest.raises(ValueError, match="published"):
        pm.publish(0, prompt + [0] * P)
    pm.check()


def test_a_duplicate_prefix_with_new_pages_after_it():
    pm = _manager()
    prompt = list(range(3 * P))
    _prefill(pm, 0, prompt)
    _prefill(pm, 1, prompt + [1] * P)
    pm.release(0, prompt)
    pm.publish(1, prompt + [1] * P)  # three duplicates, then a fourth page cached under the first copies
    pm.check()
    assert pm.match(prompt + [1] * P + [0]) == 4 * P
    assert pm.stats()["pages_evictable"] == 0  # the first copies lie above a page slot 1 holds
    assert pm.truncate(1, 3 * P) == 3 * P
    pm.check()
    assert pm.stats()["pages_evictable"] == 4
    pm.release(1)
    pm.check()
    assert pm.evict() == 4 and pm.stats()["pages_free"] == 16


def test_stats_and_prefix_caching_off():
    pm = _manager()
    prompt = list(range(2 * P + 1))
    assert _prefill(pm, 0, prompt) == 0
    pm.release(0, prompt)
    assert _prefill(pm, 0, prompt) == 2 * P
    s = pm.stats()
    assert (s["prefix_queries"], s["prefix_hits"], s["hit_rate"]) == (2 * len(prompt), 2 * P, 2 * P / (2 * len(prompt)))
    assert s["pages_total"] == 16 and s["pages_used"] == 3 and s["page_size"] == P and s["evictions"] == 0
    assert all(isinstance(v, (int, float)) for v in s.values())
    off = _manager(prefix_caching=False)
    assert off.stats()["hit_rate"] == 0.0
    _prefill(off, 0, prompt)
    off.release(0, prompt)
    assert off.match(prompt + [1]) == 0 and _prefill(off, 0, prompt) == 0
    off.release(0, prompt)
    off.check()
    assert off.stats()["pages_free"] == 16 and off.stats()["prefix_hits"] == 0


def test_scratch_page_is_never_allocated():
    pm = _manager(num_pages=4, scratch_page=True)
    assert pm.available() == 3 and pm.stats()["pages_total"] == 3
    assert pm.reserve(0, 3 * P) and pm.slot_pages(0) == [1, 2, 3] and not pm.reserve(1, 1)
    pm.release(0)
    pm.check()
    assert pm.stats()["pages_free"] == 3


class _Device:
    """The pool's contents as the device would hold them: ``page -> tokens written``, so a bug that lets
    two sequences write one page, or hands out a page with other tokens, shows as wrong contents."""

    def __init__(self, pm: PageManager):
        self.pm, self.pool = pm, {}

    def write(self, slot: int, start: int, tokens: list[int]) -> None:
        for t, token in enumerate(tokens, start):
            page = int(self.pm.table[slot, t // P])
            assert self.pm.refcount(page) == 1, "a shared page is written"
            self.pool.setdefault(page, [None] * P)[t % P] = token

    def read(self, slot: int, length: int) -> list[int]:
        return [self.pool.get(int(self.pm.table[slot, t // P]), [None] * P)[t % P] for t in range(length)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_operations_keep_every_invariant(prefix_caching):
    rng = np.random.default_rng(7 + prefix_caching)
    slots, max_pages = 4, 10
    cached: set[tuple[int, ...]] = set()  # the oracle: published whole-page prefixes not evicted

    def on_evict(page, tokens):
        assert tokens in cached and len(tokens) % P == 0
        assert not any(len(c) > len(tokens) and c[:len(tokens)] == tokens for c in cached), "not a leaf"
        cached.remove(tokens)

    pm = PageManager(16, P, slots, max_pages, prefix_caching=prefix_caching, on_evict=on_evict)
    dev = _Device(pm)
    seqs: list[list[int] | None] = [None] * slots  # tokens whose KV each slot holds
    bases = [rng.integers(0, 6, size=n).tolist() for n in (0, 2 * P + 1, 3 * P)]

    def oracle_match(tokens):
        k = 0
        while (k + 1) * P <= len(tokens) - 1 and tuple(tokens[:(k + 1) * P]) in cached:
            k += 1
        return k * P

    def publish(slot, tokens):
        if prefix_caching:
            cached.update(tuple(tokens[:k * P]) for k in range(1, len(tokens) // P + 1))

    def prompt():
        base = bases[rng.integers(len(bases))]
        tail = rng.integers(0, 6, size=rng.integers(1, 3 * P)).tolist()
        return (base + tail)[:max_pages * P - 1]

    counts = {}
    for _ in range(3000):
        slot = int(rng.integers(slots))
        seq = seqs[slot]
        op = str(rng.choice(["admit", "match", "evict"] if seq is None else
                            ["decode", "decode", "publish", "truncate", "release", "match"]))
        counts[op] = counts.get(op, 0) + 1
        if op == "admit":
            tokens = prompt()
            expected = oracle_match(tokens) if prefix_caching else 0
            got = pm.admit(slot, tokens)
            assert got == expected and got == pm.slot_capacity(slot)
            assert dev.read(slot, got) == tokens[:got]  # the cached pages hold this prompt's prefix
            computed = int(rng.integers(got + 1, len(tokens) + 1))  # a chunked prefill may stop midway
            if pm.reserve(slot, computed):
                dev.write(slot, got, tokens[got:computed])
                seqs[slot] = tokens[:computed]
            else:
                counts["refused"] = counts.get("refused", 0) + 1
                assert pm.slot_capacity(slot) == got
                pm.release(slot)
        elif op == "match":
            tokens = prompt()
            assert pm.match(tokens) == (oracle_match(tokens) if prefix_caching else 0)
        elif op == "evict":
            free, available = pm.stats()["pages_free"], pm.available()
            assert pm.evict(int(rng.integers(0, 3))) == pm.stats()["pages_free"] - free
            assert pm.available() == available
        elif op == "decode":
            new = rng.integers(0, 6, size=rng.integers(1, P + 2)).tolist()
            new = new[:max_pages * P - len(seq)]
            available, pages = pm.available(), pm.slot_pages(slot)
            if pm.reserve(slot, len(seq) + len(new)):
                dev.write(slot, len(seq), new)
                seq += new
            else:
                counts["refused"] = counts.get("refused", 0) + 1
                assert pm.slot_pages(slot) == pages and pm.available() == available
        elif op == "publish":
            tokens = seq[:int(rng.integers(0, len(seq) + 1))]
            pm.publish(slot, tokens)
            publish(slot, tokens)
        elif op == "truncate":
            length = int(rng.integers(0, len(seq) + 1))
            kept = pm.truncate(slot, length)
            assert kept == length or (length % P and kept == length // P * P)
            del seq[kept:]
        elif op == "release":
            tokens = seq if rng.random() < 0.7 else None
            pm.release(slot, tokens)
            if tokens is not None:
                publish(slot, tokens)
            seqs[slot] = None
        pm.check()
        for s, q in enumerate(seqs):
            if q is not None:
                assert dev.read(s, len(q)) == q, f"slot {s}'s KV was overwritten"
        s = pm.stats()
        assert s["pages_free"] + s["pages_cached"] + s["pages_used"] == s["pages_total"]
    assert min(counts.values()) > 5, counts  # every operation ran, refused reservations included
    if prefix_caching:
        assert pm.stats()["evictions"] > 20 and pm.stats()["prefix_hits"] > 0
    for slot, seq in enumerate(seqs):
        if seq is not None:
            pm.release(slot, seq)
            publish(slot, seq)
    pm.check()
    s = pm.stats()
    assert s["pages_used"] == 0 and s["pages_free"] + s["pages_cached"] == s["pages_total"]
    assert s["pages_cached"] == s["pages_evictable"] == len(cached)
    pm.evict()
    pm.check()
    assert pm.stats()["pages_free"] == 16 and not cached


@pytest.mark.parametrize("seed", range(3))
def test_reserve_many_is_reserve_one_slot_after_another(seed):
    """PagedBooks.reserve_many (one pass over a decode step's rows) leaves the books, the page table and
    the failures exactly as reserving each slot in turn does, also when the pool runs dry midway (evicting
    cached pages) and at max_length; pages_needed agrees with what reserving takes."""
    import copy

    from minicpm_jax.engine.paging import PagedBooks, Paging

    rng = np.random.default_rng(seed)
    books = PagedBooks(Paging(num_pages=40, page_size=16), batch_size=8, max_length=160)
    for slot in range(8):  # mixed starts: cached prefixes, lengths across page boundaries
        prompt = [int(t) for t in rng.integers(0, 3, rng.integers(1, 60))]
        cached = books.admit(slot, prompt)
        assert books.reserve(slot, len(prompt))
        books.publish(slot, prompt[: cached + (len(prompt) - cached) // 2])
    failures = 0
    for _ in range(30):
        tokens = {int(s): int(rng.integers(1, 40)) for s in rng.choice(8, rng.integers(1, 9), replace=False)}
        one = copy.deepcopy(books)
        need = one.pages_needed(tokens)
        free = one.pages.available()
        expected = [s for s, n in tokens.items() if not one.reserve(s, int(one.bound[s]) + n)]
        assert books.reserve_many(tokens) == expected
        failures += len(expected)
        assert (books.bound == one.bound).all() and (books.pages.table == one.pages.table).all()
        assert books.pages.capacities(range(8)).tolist() == [one.pages.slot_capacity(s) for s in range(8)]
        if not expected:
            assert free - one.pages.available() == need
        if rng.random() < 0.3:  # end a sequence now and then (its pages go back, full ones stay cached)
            slot = int(rng.integers(0, 8))
            books.release(slot)
            books.admit(slot, [1, 2])
    assert failures  # the pool ran dry at least once


def test_reserve_many_takes_pages_ahead_only_from_free_ones():
    """With ``ahead`` a slot crossing a page takes pages for that many more positions, from free pages only
    (a cached prefix is not evicted for them); its bound stays where its tokens end."""
    from minicpm_jax.engine.paging import PagedBooks, Paging

    books = PagedBooks(Paging(num_pages=8, page_size=16), batch_size=2, max_length=128)
    prompt = list(range(40))
    books.admit(0, prompt)
    assert books.reserve(0, 40)
    books.publish(0, prompt)  # two full pages cached
    books.release(0)
    books.admit(1, [7])
    assert books.reserve_many({1: 16}, ahead=48) == [] and books.bound[1] == 16
    assert books.pages.slot_capacity(1) == 64  # 1 page needed + 3 ahead, 4 of the 6 free ones
    assert books.reserve_many({1: 33}, ahead=48) == [] and books.bound[1] == 49
    # 49 tokens need 4 pages (held); at 65 a 5th: only 2 free pages left, so no lookahead: exactly one more.
    assert books.reserve_many({1: 16}, ahead=48) == [] and books.pages.slot_capacity(1) == 80
    assert books.pages.free_pages == 1 and books.cached(prompt) == 32  # the cached prefix survived
