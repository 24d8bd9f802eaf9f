"""EAGLE-2 speculative decoding, the round math: dynamic draft trees, tree verification, acceptance and KV
compaction, a whole round (and a block of rounds) inside one jit. The engine that runs them is
:mod:`minicpm_jax.engine.speculative.engine`.

One round, per row (all rows of the batch at once, static shapes):

1. **Catch-up** — the draft reads the pairs (target feature f_t, token x_{t+1}) committed by the last
   round (the last pair ends with the root r, the newest token, not yet in the target cache).
2. **Tree expansion** (EAGLE-2) — top-k of the draft's log-probabilities give k depth-1 candidates; each
   of ``num_iter - 1`` draft steps runs the k best frontier nodes (its tree keys limited to ancestors),
   adds ``k·k`` candidates scored by cumulative log-probability and keeps the best k as the next frontier.
   The ``tree_size - 1`` best candidates, in creation order, become the tree under the root.
3. **Verify** — one target forward over the tree (node i at cache slot ``L + i``, RoPE position
   ``L + depth``, attending to the prefix and its ancestors: ``pallas_kernels.tree_attention``).
4. **Accept** — the target's token at every node (argmax, or a sample drawn independently per node);
   by the acceptance rule (default :func:`match_target`), node i is correct iff its token equals its
   parent's target token; the deepest node whose whole path is
   correct ends the accepted path; the target tokens along the path are emitted (accepted drafts plus
   one bonus token, which is the next root). Greedy output equals plain greedy decoding; sampled output
   has the target's distribution (sample-then-match over deterministic drafts).
5. **Compact** — K/V of the path nodes move from slots ``L + node`` to ``L + depth`` in every layer; the
   cache length becomes ``L + accepted``. The draft's tree keys are simply overwritten next round.

FR-Spec restricts the draft's head and top-k to a frequency-ranked subset of the vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from minicpm_jax.engine.sampling import sample
from minicpm_jax.engine.stops import DecodeState, apply_stops, live_block
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import KVCache, TreeInputs
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from pallas_kernels.topk import top_k
from pallas_kernels.tree_attention import MAX_TREE_NODES


# The ``jax.named_scope`` of each part of a round (draft, verify, accept, compact; the stop checks and state
# updates after them have none): a profile attributes each kernel to its part by its op path
# (``benchmarks/spec.py``'s split of a round).
ROUND_PHASES = ("spec_draft", "spec_verify", "spec_accept", "spec_compact")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Tree settings (CPM.cu's run defaults).

    num_iter: draft steps per round = deepest tree level (at most ``num_iter + 1`` tokens per round).
    topk_per_iter: children per expanded node and frontier width. tree_size: verified nodes, root
    included (≤ 64). window_size: committed tokens the draft attends to in a round (0 = all).
    """

    num_iter: int = 2
    topk_per_iter: int = 10
    tree_size: int = 12
    window_size: int = 1024

    @property
    def max_accept(self) -> int:
        return self.num_iter + 1

    @property
    def draft_slots(self) -> int:
        """Draft-cache slots a round's tree steps write after the committed pairs."""
        return self.topk_per_iter * (self.num_iter - 1)

    @property
    def num_candidates(self) -> int:
        return self.topk_per_iter + (self.num_iter - 1) * self.topk_per_iter**2

    def check(self) -> "SpecConfig":
        if self.num_iter < 1 or self.topk_per_iter < 1 or self.window_size < 0:
            raise MiniCPMError("spec_num_iter and spec_topk_per_iter must be >= 1, spec_window_size >= 0")
        if not 1 <= self.tree_size <= MAX_TREE_NODES:
            raise MiniCPMError(f"spec_tree_size must be in 1..{MAX_TREE_NODES}, got {self.tree_size}")
        if self.tree_size - 1 > self.num_candidates:
            raise MiniCPMError(f"spec_tree_size {self.tree_size} exceeds the {self.num_candidates} candidates of "
                               f"{self.num_iter} draft steps of top-{self.topk_per_iter} (plus the root)")
        if self.draft_slots > MAX_TREE_NODES:
            raise MiniCPMError(f"spec_topk_per_iter x (spec_num_iter - 1) must be <= {MAX_TREE_NODES}, got {self.draft_slots}")
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """Per-row speculative state between rounds (device arrays).

    dcache: the draft's one-layer cache. pend_tok ``int32[B, A]``, pend_feat ``[B, A, H]``, pend_n
    ``int32[B]``: the committed (feature, next token) pairs the draft has not read yet (A = num_iter + 1).
    accepted ``int32[B, A + 1]``: how many rounds emitted 0..A tokens.
    """

    dcache: KVCache
    pend_tok: jax.Array
    pend_feat: jax.Array
    pend_n: jax.Array
    accepted: jax.Array


def draft_log_probs(model: MiniCPMForCausalLM, draft: EagleDraft, hidden: jax.Array, head: jax.Array | None) -> jax.Array:
    """fp32 log-probabilities of the draft: over its own vocabulary (EAGLE-3), over the target
    vocabulary through the target lm_head, or over the FR-Spec subset whose lm_head rows are
    ``head [V', H]`` (:meth:`~minicpm_jax.model.causal_lm.MiniCPMForCausalLM.head_rows`; with the target's
    logit scale, unlike CPM.cu)."""
    logits = draft.logits(hidden) if draft.own_head else model.logits(hidden, head)
    return jax.nn.log_softmax(logits, axis=-1)


def target_forward(model: MiniCPMForCausalLM, draft: EagleDraft, tokens, cache, num_valid, mode="dense", tree=None):
    """Target forward returning (final hidden ``[B, T, H]``, the draft's features ``[B, T, F]``, cache):
    the final hidden itself (EAGLE-1/2), or the residual streams entering the capture layers (EAGLE-3)."""
    hidden, captured, cache = model.forward_features(tokens, cache, num_valid, mode, tree, capture=draft.spec.capture)
    return hidden, (jnp.concatenate(captured, axis=-1) if captured else hidden), cache


def catch_up(model, draft: EagleDraft, st: SpecState, window: int | None):
    """The draft reads the pending pairs; returns (hidden of each row's last pair ``[B, H]``, draft cache).

    The pairs run as tree tokens (a causal mask, the draft's window), committed: a paged pool stores them in
    its pages as well as in the scratch region the tree attention reads."""
    b, a = st.pend_tok.shape
    prefix = st.dcache.lengths
    j = jnp.arange(a, dtype=jnp.int32)
    valid = j[None, :] < st.pend_n[:, None]
    mask = (j[None, :, None] >= j[None, None, :]) & valid[:, None, :]
    h, dcache = draft(model.embed(st.pend_tok), st.pend_feat, prefix[:, None] + j[None, :], valid, st.dcache,
                      TreeInputs(prefix, mask, 0, window, committed=True))
    dcache = dataclasses.replace(dcache, lengths=prefix + st.pend_n)
    last = jnp.take_along_axis(h, jnp.maximum(st.pend_n - 1, 0)[:, None, None], axis=1)[:, 0]
    # A finished row has no pair pending: its hidden is the output of a masked query, which has expanded
    # into NaN tree hiddens (bf16, random weights). The tree is discarded, but its K/V land in the draft
    # cache past the row's length, where a later read weighting them by zero still turns NaN (0 · NaN).
    return jnp.where((st.pend_n > 0)[:, None], last, 0).astype(last.dtype), dcache


def expand_tree(model, draft: EagleDraft, dcache: KVCache, h_last, head, ids, spec: SpecConfig, window):
    """EAGLE-2 expansion. Returns node tokens ``int32[B, N-1]`` (without the root), their depths, their
    parents (node index, 0 = root; -1 = parent not in the tree), and draft scores, in creation order, and
    the draft cache: ``dcache`` with the drafted nodes' K/V in the tree slots past its lengths, which no
    later read sees unmasked (keep it rather than ``dcache``: XLA then writes the nodes in place instead of
    copying the whole draft cache every round)."""
    b = h_last.shape[0]
    lengths = dcache.lengths
    k, m = spec.topk_per_iter, spec.draft_slots
    to_token = (lambda i: i) if ids is None else (lambda i: ids[i])
    score, idx = top_k(draft_log_probs(model, draft, h_last, head), k)  # [B, k]
    tok = to_token(idx)
    cands_tok, cands_score, cands_parent, cands_depth = [tok], [score], [jnp.full((b, k), -1, jnp.int32)], [1]
    front_tok, front_score, front_id = tok, score, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    front_h = jnp.broadcast_to(h_last[:, None, :], (b, k, h_last.shape[-1]))
    anc = jnp.zeros((b, k, max(m, 1)), bool)
    base = k
    for i in range(1, spec.num_iter):
        own = jax.nn.one_hot((i - 1) * k + jnp.arange(k), max(m, 1), dtype=bool)
        mask = anc | own[None]
        positions = jnp.broadcast_to(dcache.lengths[:, None] - 1 + i, (b, k))
        h, dcache = draft(model.embed(front_tok), front_h, positions, jnp.ones((b, k), bool), dcache,
                          TreeInputs(dcache.lengths, mask, (i - 1) * k, window), from_target=False)
        s, ix = top_k(draft_log_probs(model, draft, h, head), k)  # [B, k, k]
        cum = (front_score[:, :, None] + s).reshape(b, k * k)
        new_tok = to_token(ix).reshape(b, k * k)
        cands_tok.append(new_tok)
        cands_score.append(cum)
        cands_parent.append(jnp.repeat(front_id, k, axis=1))
        cands_depth.append(i + 1)
        front_score, pick = lax.top_k(cum, k)
        parent = pick // k
        front_tok = jnp.take_along_axis(new_tok, pick, axis=1)
        front_h = jnp.take_along_axis(h, parent[:, :, None], axis=1)
        anc = jnp.take_along_axis(mask, parent[:, :, None], axis=1)
        front_id = base + pick
        base += k * k
    tok = jnp.concatenate(cands_tok, axis=1)
    score = jnp.concatenate(cands_score, axis=1)
    parent = jnp.concatenate(cands_parent, axis=1)
    depth = jnp.concatenate([jnp.full((b, c.shape[1]), d, jnp.int32) for c, d in zip(cands_tok, cands_depth)], axis=1)
    n = spec.tree_size - 1
    _, sel = lax.top_k(score, n)
    sel = jnp.sort(sel, axis=1)  # creation order: parents before children
    take = functools.partial(jnp.take_along_axis, axis=1)
    pc = take(parent, sel)
    match = sel[:, None, :] == pc[:, :, None]  # [B, n, n]: selected j is node i's parent
    node_parent = jnp.where(pc < 0, 0, jnp.where(jnp.any(match, axis=2), jnp.argmax(match, axis=2) + 1, -1))
    return (take(tok, sel), take(depth, sel), node_parent.astype(jnp.int32), take(score, sel),
            dataclasses.replace(dcache, lengths=lengths))


def tree_masks(parent: jax.Array, depth_limit: int) -> jax.Array:
    """Ancestor-or-self masks ``bool[B, N, N]`` from parents ``int32[B, N]`` (node 0 = root, parent of
    the root and of orphans: ignored/0; trees at most ``depth_limit`` deep)."""
    b, n = parent.shape
    step = jax.nn.one_hot(jnp.where(jnp.arange(n) == 0, -1, jnp.maximum(parent, 0)), n, dtype=jnp.int32)
    reach = cur = jnp.broadcast_to(jnp.eye(n, dtype=jnp.int32), (b, n, n))
    for _ in range(depth_limit):
        cur = jnp.minimum(jnp.einsum("bij,bjk->bik", cur, step), 1)
        reach = reach | cur
    return reach.astype(bool)


class DraftTree(NamedTuple):
    """A round's tree, node 0 the root (the newest token), in creation order (parents before children).

    tokens / depth / parent (0 for the root and its children; -1: parent not in the tree) ``int32[B, N]``;
    score ``f32[B, N]`` (the draft's cumulative log-probability); mask ``bool[B, N, N]`` (ancestors and self).
    """

    tokens: jax.Array
    depth: jax.Array
    parent: jax.Array
    score: jax.Array
    mask: jax.Array


# An acceptance rule: (tree, the target's token at every node int32[B, N], nodes stored in the cache
# bool[B, N]) -> bool[B, N], the nodes judged correct (the root always is); a node is accepted when it and
# all its ancestors are correct.
AcceptRule = Callable[[DraftTree, jax.Array, jax.Array], jax.Array]


def match_target(tree: DraftTree, target: jax.Array, stored: jax.Array) -> jax.Array:
    """The speculative-decoding rule: node i is correct iff its token is the target's token at its parent
    (greedy output then equals plain greedy decoding; sampled output has the target's distribution, the
    drafts being deterministic). Orphans and nodes past the end of the cache never are."""
    correct = tree.tokens == jnp.take_along_axis(target, jnp.maximum(tree.parent, 0), axis=1)
    correct = correct & (tree.parent >= 0) & stored
    return correct.at[:, 0].set(True)


def run_round(model, draft, head, ids, cache: KVCache, ds: DecodeState, st: SpecState, *, spec: SpecConfig,
              accept: AcceptRule = match_target, sampling: str = "auto", mode: str = "auto"):
    """One speculative round for every active row; returns (cache, ds, st, emitted ``int32[B, A]`` (-1 = none)).

    accept: the acceptance rule (:func:`match_target`). mode (static): the target's attention for sparse
    models (``dense`` / ``sparse`` / ``mixed``, see :meth:`MiniCPMForCausalLM.forward_features`)."""
    b = ds.tok.shape[0]
    a_max, n = spec.max_accept, spec.tree_size
    active = ~ds.done
    window = spec.window_size or None
    if draft.own_head:  # EAGLE-3: draft ids -> target ids
        ids = draft.target_ids()
    with jax.named_scope(ROUND_PHASES[0]):
        h_last, dcache = catch_up(model, draft, st, window)
        # Tree (node 0 = root).
        if n > 1:
            c_tok, c_depth, c_parent, c_score, dcache = expand_tree(model, draft, dcache, h_last, head, ids, spec,
                                                                    window)
            tokens = jnp.concatenate([ds.tok[:, None], c_tok], axis=1)
            depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), c_depth], axis=1)
            parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), c_parent], axis=1)
            score = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), c_score], axis=1)
        else:
            tokens, depth = ds.tok[:, None], jnp.zeros((b, 1), jnp.int32)
            parent, score = jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1))
        tree = DraftTree(tokens, depth, parent, score, tree_masks(parent, spec.num_iter))
    prefix = cache.lengths
    with jax.named_scope(ROUND_PHASES[1]):
        hidden, features, cache = target_forward(model, draft, tokens, cache, jnp.where(active, n, 0), mode=mode,
                                                 tree=(depth, tree.mask))
        logits = model.logits(hidden)
    with jax.named_scope(ROUND_PHASES[2]):
        # The target's token at every node: argmax, or an independent draw per node.
        steps = ds.n_gen[:, None] * MAX_TREE_NODES + jnp.arange(n, dtype=jnp.int32)[None, :]
        rep = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
        target = sample(logits.reshape(b * n, -1), rep(ds.keys), steps.reshape(-1), rep(ds.temperature),
                        rep(ds.top_k), rep(ds.top_p), sampling).reshape(b, n)
        # Nodes past the end of the cache were not stored: never accepted (a full tree needs no free room).
        stored = prefix[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :] < cache.max_length
        correct = accept(tree, target, stored)
        accepted_node = ~jnp.any(tree.mask & ~correct[:, None, :], axis=2)  # all ancestors (and itself) correct
        end = jnp.argmax(jnp.where(accepted_node, depth, -1), axis=1)  # deepest accepted node
        n_acc = jnp.take_along_axis(depth, end[:, None], axis=1)[:, 0] + 1
        on_path = jnp.take_along_axis(tree.mask, end[:, None, None], axis=1)[:, 0]  # [B, N]
        levels = jnp.arange(a_max, dtype=jnp.int32)
        path = jnp.argmax(on_path[:, None, :] & (depth[:, None, :] == levels[None, :, None]), axis=2).astype(jnp.int32)
        emitted = jnp.take_along_axis(target, path, axis=1)  # [B, A]; valid below n_acc
    with jax.named_scope(ROUND_PHASES[3]):
        cache = cache.commit_path(prefix, path, jnp.where(active, n_acc, 0))
        cache = model.extend_compressed(cache, prefix, cache.lengths, a_max)  # sparse: K1/K2 of the accepted path
    ds, keep = apply_stops(ds, emitted, n_acc, active, cache.lengths, cache.max_length)
    feats = jnp.take_along_axis(features, path[:, :, None], axis=1)
    counted = jnp.where(active, n_acc, 0)
    st = SpecState(
        dcache=dcache, pend_tok=emitted, pend_feat=feats.astype(st.pend_feat.dtype), pend_n=counted,
        accepted=st.accepted + (jax.nn.one_hot(counted, a_max + 1, dtype=jnp.int32) * active[:, None]),
    )
    return cache, ds, st, jnp.where(keep, emitted, -1)


def spec_block(graphdef, state, dstate, head, ids, cache, ds, st, *, dgraph, rounds: int, spec: SpecConfig,
               accept: AcceptRule = match_target, sampling: str = "auto", mode: str = "auto",
               check_each: bool = False):
    """Up to ``rounds`` rounds on device while a row is live (:func:`~minicpm_jax.engine.stops.live_block`
    with ``check_each``: checked before every round, or once at the block's start); returns (cache, ds, st, tokens
    ``int32[B, rounds·A]``, -1 = none).
    graphdef / dgraph: the target's and the draft's static graphs; state / dstate their arrays."""
    model, draft = nnx.merge(graphdef, state), nnx.merge(dgraph, dstate)
    a = spec.max_accept
    out = jnp.full((ds.tok.shape[0], rounds * a), -1, jnp.int32)
    st = dataclasses.replace(st, dcache=st.dcache.with_pages_of(cache))  # a paged draft pool: the target's pages

    def body(carry):
        i, cache, ds, st, out = carry
        cache, ds, st, emitted = run_round(model, draft, head, ids, cache, ds, st, spec=spec, accept=accept,
                                           sampling=sampling, mode=mode)
        out = lax.dynamic_update_slice(out, emitted, (0, i * a))
        return i + 1, cache, ds, st, out

    _, cache, ds, st, out = live_block(body, (jnp.int32(0), cache, ds, st, out), rounds, check_each)
    return cache, ds, st, out


def spec_prefill_chunk(graphdef, state, dstate, cache, dcache, tokens, next_tokens, num_valid, draft_valid,
                        last_logits, last_feat, *, dgraph, mode: str = "dense"):
    """A prompt chunk through the target, then its (feature, next token) pairs through the draft.

    Keeps each row's last-token logits and final feature (the feature of the pair the root completes)."""
    model, draft = nnx.merge(graphdef, state), nnx.merge(dgraph, dstate)
    hidden, features, cache = target_forward(model, draft, tokens, cache, num_valid, mode=mode)
    dcache = dcache.with_pages_of(cache)  # a paged draft pool: the target's pages
    c = tokens.shape[1]
    positions = dcache.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    valid = jnp.arange(c)[None, :] < draft_valid[:, None]
    _, dcache = draft(model.embed(next_tokens), features, positions, valid, dcache)
    last_index = jnp.maximum(num_valid - 1, 0)[:, None, None]
    last = jnp.take_along_axis(hidden, last_index, axis=1)[:, 0]
    feat = jnp.take_along_axis(features, last_index, axis=1)[:, 0]
    has = (num_valid > 0)[:, None]
    return cache, dcache, jnp.where(has, model.logits(last), last_logits), jnp.where(has, feat, last_feat)


def spec_prefill_rows(graphdef, state, dstate, cache, dcache, idx, tokens, next_tokens, num_valid, draft_valid,
                      last_feat, *, dgraph, mode: str = "dense"):
    """:func:`spec_prefill_chunk` for the slots ``idx int32[b]`` alone (``tokens`` … ``draft_valid`` are
    theirs, ``[b, C]`` / ``[b]``): their target and draft cache rows and final features are taken out, run
    and put back; the other slots are neither computed nor changed. Returns (cache, dcache, logits
    ``f32[B, V]`` of each row's last real token, zeros for the other slots, last_feat ``[B, F]``)."""
    b, batch = idx.shape[0], cache.lengths.shape[0]
    vocab = nnx.merge(graphdef, state).config.vocab_size
    rows, drows, logits, feat = spec_prefill_chunk(
        graphdef, state, dstate, cache.take_rows(idx), dcache.take_rows(idx), tokens, next_tokens, num_valid,
        draft_valid, jnp.zeros((b, vocab), jnp.float32), last_feat[idx], dgraph=dgraph, mode=mode)
    full = jnp.zeros((batch, vocab), jnp.float32).at[idx].set(logits)
    return cache.put_rows(idx, rows), dcache.put_rows(idx, drows), full, last_feat.at[idx].set(feat)
