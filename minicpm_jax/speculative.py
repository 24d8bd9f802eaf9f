"""EAGLE-2 speculative decoding: dynamic draft trees, tree verification, acceptance and KV compaction, a
whole round inside one jit, and the engine that runs it.

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
   node i is correct iff its token equals its parent's target token; the deepest node whose whole path is
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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from minicpm_jax.attention import TreeInputs
from minicpm_jax.cache import KVCache
from minicpm_jax.eagle import EagleDraft
from minicpm_jax.engine import FINISH_LENGTH, FINISH_STOP, MIN_CHUNK, DecodeState, Engine
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model import MiniCPMForCausalLM
from minicpm_jax.sampling import sample
from minicpm_jax.sparse import tree_depth_limit
from minicpm_jax.topk import top_k
from pallas_kernels.tree_attention import MAX_TREE_NODES


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Tree settings (CPM.cu's run defaults).

    num_iter: draft steps per round = deepest tree level (at most ``num_iter + 1`` tokens per round).
    topk_per_iter: children per expanded node and frontier width. tree_size: verified nodes, root
    included (≤ 64). window_size: committed tokens the draft attends to in a round (0 = all).
    oracle_accept: benchmarks only — every round accepts the draft's best chain down to depth
    ``oracle_accept - 1`` whatever the tokens, so a round costs exactly what a real round with that
    accept length costs (the emitted tokens are the target's argmax along the chain).
    """

    num_iter: int = 2
    topk_per_iter: int = 10
    tree_size: int = 12
    window_size: int = 1024
    oracle_accept: int = 0

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
        if not 0 <= self.oracle_accept <= self.max_accept:
            raise MiniCPMError(f"spec_oracle_accept must be in 0..{self.max_accept} (spec_num_iter + 1)")
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


def frspec_head(model: MiniCPMForCausalLM, ids: np.ndarray) -> jax.Array:
    """The draft head of an FR-Spec subset: rows ``ids`` of the target lm_head, ``[V', H]``."""
    idx = jnp.asarray(ids, jnp.int32)
    if model.config.tied_head:
        return model.model.embed_tokens.embedding[...][idx]
    return model.lm_head.kernel[...][:, idx].T


def draft_log_probs(model: MiniCPMForCausalLM, draft: EagleDraft, hidden: jax.Array, head: jax.Array | None) -> jax.Array:
    """fp32 log-probabilities of the draft: over its own vocabulary (EAGLE-3), over the target
    vocabulary through the target lm_head, or over the FR-Spec subset whose lm_head rows are
    ``head [V', H]`` (with the target's logit scale, unlike CPM.cu)."""
    if draft.own_head:
        logits = draft.logits(hidden)
    elif head is None:
        logits = model.logits(hidden)
    else:
        h = hidden * jnp.asarray(model.config.logit_scale, hidden.dtype)
        logits = jnp.einsum("...h,vh->...v", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
    return jax.nn.log_softmax(logits, axis=-1)


def compact_cache(cache: KVCache, prefix: jax.Array, path: jax.Array, accepted: jax.Array) -> KVCache:
    """Moves the accepted path's K/V into place: slot ``prefix + path[:, j]`` → ``prefix + j`` for
    ``j < accepted`` in every layer; lengths become ``prefix + accepted``.

    prefix, accepted ``int32[B]``; path ``int32[B, A]`` (tree node of each depth, root first).
    """
    b, a = path.shape
    rows = jnp.arange(b)[:, None]
    src = jnp.minimum(prefix[:, None] + path, cache.max_length - 1)
    k = cache.k[:, rows, :, src]  # [B, A, L, KVH, D] (advanced indices first)
    v = cache.v[:, rows, :, src]
    j = jnp.arange(a, dtype=jnp.int32)[None, :]
    dst = jnp.where(j < accepted[:, None], prefix[:, None] + j, cache.max_length)  # out of range: dropped
    return dataclasses.replace(
        cache,
        k=cache.k.at[:, rows, :, dst].set(k, mode="drop"),
        v=cache.v.at[:, rows, :, dst].set(v, mode="drop"),
        lengths=prefix + accepted,
    )


def _embed(model: MiniCPMForCausalLM, tokens: jax.Array) -> jax.Array:
    return model.model.embed_tokens(tokens).astype(model.dtype) * jnp.asarray(model.config.scale_emb, model.dtype)


def target_forward(model: MiniCPMForCausalLM, draft: EagleDraft, tokens, cache, num_valid, mode="dense", tree=None):
    """Target forward returning (final hidden ``[B, T, H]``, the draft's features ``[B, T, F]``, cache):
    the final hidden itself (EAGLE-1/2), or the residual streams entering the capture layers (EAGLE-3)."""
    hidden, captured, cache = model.forward_features(tokens, cache, num_valid, mode, tree, capture=draft.spec.capture)
    return hidden, (jnp.concatenate(captured, axis=-1) if captured else hidden), cache


def _catch_up(model, draft: EagleDraft, st: SpecState, window: int | None):
    """The draft reads the pending pairs; returns (hidden of each row's last pair ``[B, H]``, draft cache)."""
    b, a = st.pend_tok.shape
    prefix = st.dcache.lengths
    j = jnp.arange(a, dtype=jnp.int32)
    valid = j[None, :] < st.pend_n[:, None]
    mask = (j[None, :, None] >= j[None, None, :]) & valid[:, None, :]
    h, dcache = draft(_embed(model, st.pend_tok), st.pend_feat, prefix[:, None] + j[None, :], valid, st.dcache,
                      TreeInputs(prefix, mask, 0, window))
    dcache = dataclasses.replace(dcache, lengths=prefix + st.pend_n)
    last = jnp.take_along_axis(h, jnp.maximum(st.pend_n - 1, 0)[:, None, None], axis=1)[:, 0]
    return last, dcache


def _expand_tree(model, draft: EagleDraft, dcache: KVCache, h_last, head, ids, spec: SpecConfig, window):
    """EAGLE-2 expansion. Returns node tokens ``int32[B, N-1]`` (without the root), their depths, their
    parents (node index, 0 = root; -1 = parent not in the tree), and draft scores, in creation order."""
    b = h_last.shape[0]
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
        h, dcache = draft(_embed(model, front_tok), front_h, positions, jnp.ones((b, k), bool), dcache,
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
    return take(tok, sel), take(depth, sel), node_parent.astype(jnp.int32), take(score, sel)


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


def _round(model, draft, head, ids, cache: KVCache, ds: DecodeState, st: SpecState, *, spec: SpecConfig,
           sampling: str = "auto", mode: str = "auto"):
    """One speculative round for every active row; returns (cache, ds, st, emitted ``int32[B, A]`` (-1 = none)).

    mode (static): the target's attention for sparse models (``dense`` / ``sparse`` / ``mixed``, see
    :meth:`MiniCPMForCausalLM.forward_features`)."""
    b = ds.tok.shape[0]
    a_max, n = spec.max_accept, spec.tree_size
    active = ~ds.done
    window = spec.window_size or None
    if draft.own_head:  # EAGLE-3: draft ids -> target ids
        ids = draft.target_ids()
    h_last, dcache = _catch_up(model, draft, st, window)
    # Tree (node 0 = root).
    if n > 1:
        c_tok, c_depth, c_parent, c_score = _expand_tree(model, draft, dcache, h_last, head, ids, spec, window)
        tokens = jnp.concatenate([ds.tok[:, None], c_tok], axis=1)
        depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), c_depth], axis=1)
        parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), c_parent], axis=1)
        score = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), c_score], axis=1)
    else:
        tokens, depth, parent, score = ds.tok[:, None], jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1))
    orphan = parent < 0  # never accepted, nor anything under it
    mask = tree_masks(parent, spec.num_iter)
    prefix = cache.lengths
    hidden, features, cache = target_forward(model, draft, tokens, cache, jnp.where(active, n, 0), mode=mode,
                                             tree=(depth, mask))
    logits = model.logits(hidden)
    # The target's token at every node: argmax, or an independent draw per node.
    steps = ds.n_gen[:, None] * MAX_TREE_NODES + jnp.arange(n, dtype=jnp.int32)[None, :]
    rep = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
    target = sample(logits.reshape(b * n, -1), rep(ds.keys), steps.reshape(-1), rep(ds.temperature), rep(ds.top_k),
                    rep(ds.top_p), sampling).reshape(b, n)
    parent0 = jnp.maximum(parent, 0)
    # Nodes past the end of the cache were not stored: never accepted (a full tree needs no free room).
    stored = prefix[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :] < cache.max_length
    correct = (tokens == jnp.take_along_axis(target, parent0, axis=1)) & ~orphan & stored
    correct = correct.at[:, 0].set(True)
    if spec.oracle_accept:  # benchmark: the draft's best chain down to depth oracle_accept - 1 counts as correct
        best = jnp.argmax(jnp.where(depth <= spec.oracle_accept - 1, depth * 1e6 + score, -jnp.inf), axis=1)
        correct = jnp.take_along_axis(mask, best[:, None, None], axis=1)[:, 0] | (jnp.arange(n) == 0)
    accepted_node = ~jnp.any(mask & ~correct[:, None, :], axis=2)  # all ancestors (and itself) correct
    end = jnp.argmax(jnp.where(accepted_node, depth, -1), axis=1)  # deepest accepted node
    n_acc = jnp.take_along_axis(depth, end[:, None], axis=1)[:, 0] + 1
    on_path = jnp.take_along_axis(mask, end[:, None, None], axis=1)[:, 0]  # [B, N]
    levels = jnp.arange(a_max, dtype=jnp.int32)
    path = jnp.argmax(on_path[:, None, :] & (depth[:, None, :] == levels[None, :, None]), axis=2).astype(jnp.int32)
    emitted = jnp.take_along_axis(target, path, axis=1)  # [B, A]; valid below n_acc
    cache = compact_cache(cache, prefix, path, jnp.where(active, n_acc, 0))
    cache = model.extend_compressed(cache, prefix, cache.lengths, a_max)  # sparse: K1/K2 of the accepted path

    # Stops: budget, stop ids (inclusive), a full cache.
    in_round = (levels[None, :] < n_acc[:, None]) & active[:, None]
    budget = ds.n_gen[:, None] + levels[None, :] < ds.max_new[:, None]
    is_stop = jnp.any(emitted[:, :, None] == ds.stop_ids[:, None, :], axis=2) & in_round & budget
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), a_max)
    keep = in_round & budget & (levels[None, :] <= first_stop[:, None])
    n_emit = jnp.sum(keep, axis=1, dtype=jnp.int32)
    n_gen = ds.n_gen + n_emit
    hit_stop = active & (first_stop < a_max)
    hit_len = active & ~hit_stop & ((n_gen >= ds.max_new) | (cache.lengths >= cache.max_length))
    last = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    ds = dataclasses.replace(
        ds, tok=jnp.where(active, last, ds.tok), n_gen=n_gen, done=ds.done | hit_stop | hit_len,
        finish=jnp.where(hit_stop, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, ds.finish)).astype(jnp.int32),
    )
    feats = jnp.take_along_axis(features, path[:, :, None], axis=1)
    counted = jnp.where(active, n_acc, 0)
    st = SpecState(
        dcache=dcache, pend_tok=emitted, pend_feat=feats.astype(st.pend_feat.dtype), pend_n=counted,
        accepted=st.accepted + (jax.nn.one_hot(counted, a_max + 1, dtype=jnp.int32) * active[:, None]),
    )
    return cache, ds, st, jnp.where(keep, emitted, -1)


def _spec_block(graphdef, state, dgraph, dstate, head, ids, cache, ds, st, *, rounds: int, spec: SpecConfig,
                sampling: str = "auto", mode: str = "auto"):
    """Up to ``rounds`` rounds on device; returns (cache, ds, st, tokens ``int32[B, rounds·A]``, -1 = none)."""
    model, draft = nnx.merge(graphdef, state), nnx.merge(dgraph, dstate)
    a = spec.max_accept
    out = jnp.full((ds.tok.shape[0], rounds * a), -1, jnp.int32)

    def cond(carry):
        i, _, ds, _, _ = carry
        return (i < rounds) & jnp.any(~ds.done)

    def body(carry):
        i, cache, ds, st, out = carry
        cache, ds, st, emitted = _round(model, draft, head, ids, cache, ds, st, spec=spec, sampling=sampling,
                                        mode=mode)
        out = lax.dynamic_update_slice(out, emitted, (0, i * a))
        return i + 1, cache, ds, st, out

    _, cache, ds, st, out = lax.while_loop(cond, body, (jnp.int32(0), cache, ds, st, out))
    return cache, ds, st, out


def _spec_prefill_chunk(graphdef, state, dgraph, dstate, cache, dcache, tokens, next_tokens, num_valid, draft_valid,
                        last_logits, last_feat, mode: str = "dense"):
    """A prompt chunk through the target, then its (feature, next token) pairs through the draft.

    Keeps each row's last-token logits and final feature (the feature of the pair the root completes)."""
    model, draft = nnx.merge(graphdef, state), nnx.merge(dgraph, dstate)
    hidden, features, cache = target_forward(model, draft, tokens, cache, num_valid, mode=mode)
    c = tokens.shape[1]
    positions = dcache.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    valid = jnp.arange(c)[None, :] < draft_valid[:, None]
    _, dcache = draft(_embed(model, next_tokens), features, positions, valid, dcache)
    last_index = jnp.maximum(num_valid - 1, 0)[:, None, None]
    last = jnp.take_along_axis(hidden, last_index, axis=1)[:, 0]
    feat = jnp.take_along_axis(features, last_index, axis=1)[:, 0]
    has = (num_valid > 0)[:, None]
    return cache, dcache, jnp.where(has, model.logits(last), last_logits), jnp.where(has, feat, last_feat)


class SpeculativeEngine(Engine):
    """:class:`Engine` whose decode runs EAGLE-2 speculative rounds.

    Args:
      model: the target. draft: its :class:`~minicpm_jax.eagle.EagleDraft` (same dtype).
      spec: tree settings. frspec_ids: FR-Spec subset ``int32[V']`` (``eagle.read_frspec``), or None.
      decode_block: rounds per host round trip. Other arguments as :class:`Engine`.
    Sparse (InfLLM-v2) targets verify each tree node as plain sparse decoding of its path would, and extend
    the compressed keys by the accepted tokens (trees at most :func:`~minicpm_jax.sparse.tree_depth_limit`
    deep).
    """

    def __init__(self, model: MiniCPMForCausalLM, draft: EagleDraft, *, spec: SpecConfig = SpecConfig(),
                 frspec_ids: np.ndarray | None = None, batch_size: int = 1, chunk_length: int = 256,
                 decode_block: int = 4):
        super().__init__(model, batch_size=batch_size, chunk_length=chunk_length, decode_block=decode_block)
        if draft.spec.layer.hidden_size != model.config.hidden_size or draft.spec.layer.vocab_size != model.config.vocab_size:
            raise MiniCPMError("the draft's hidden size / vocabulary do not match the target's")
        self.spec = spec.check()
        if frspec_ids is not None and draft.own_head:
            raise MiniCPMError("FR-Spec applies to drafts that use the target's lm_head; an EAGLE-3 draft has its own "
                               "reduced vocabulary (drop --frspec_path)")
        draft_vocab = (len(frspec_ids) if frspec_ids is not None else
                       draft.spec.draft_vocab if draft.own_head else model.config.vocab_size)
        if spec.topk_per_iter > draft_vocab:
            raise MiniCPMError(f"spec_topk_per_iter {spec.topk_per_iter} exceeds the draft's vocabulary of {draft_vocab} ids")
        if self.max_length < 16:
            raise MiniCPMError(f"speculative decoding needs max_length >= 16, got {self.max_length}")
        if model.sparse_active and spec.num_iter > tree_depth_limit(model.sparse):
            raise MiniCPMError(
                f"spec_num_iter {spec.num_iter} is deeper than sparse attention verifies exactly with this sparse_config "
                f"(at most {tree_depth_limit(model.sparse)}: shorter than the coarse stride, inside the local window)")
        self.draft = draft
        self.dgraph, self.dstate = nnx.split(draft)
        self.ids = None if frspec_ids is None else jnp.asarray(frspec_ids, jnp.int32)
        self.head = None if frspec_ids is None else frspec_head(model, frspec_ids)
        self.dcache = draft.new_cache(batch_size, self.max_length + spec.draft_slots + spec.max_accept)
        self.last_feat = jnp.zeros((batch_size, draft.spec.feature_size), model.dtype)
        self._jitted["spec_prefill"] = jax.jit(
            lambda state, dstate, cache, dcache, *rest, mode: _spec_prefill_chunk(
                self.graphdef, state, self.dgraph, dstate, cache, dcache, *rest, mode=mode),
            donate_argnums=(2, 3), static_argnames="mode")
        self._jitted["spec_decode"] = jax.jit(
            lambda state, dstate, head, ids, cache, ds, st, sampling, mode: _spec_block(
                self.graphdef, state, self.dgraph, dstate, head, ids, cache, ds, st, rounds=decode_block, spec=self.spec,
                sampling=sampling, mode=mode),
            donate_argnums=(4, 6), static_argnames=("sampling", "mode"))
        self.last_accepted: np.ndarray | None = None  # rounds by tokens emitted, of the last decode loop

    def reset(self) -> None:
        super().reset()
        self.dcache = self.dcache.reset()

    def _truncate(self, lengths: list[int]) -> None:
        super()._truncate(lengths)
        # Draft pair t = (f_t, x_{t+1}) is valid while x_{t+1} is cached; the tail prefill restarts at the
        # length, so the draft holds exactly the pairs before it.
        self.dcache = dataclasses.replace(self.dcache, lengths=jnp.asarray(lengths, jnp.int32))

    def _common_prefix(self, row: int, ids: list[int]) -> int:
        # One token less than the plain engine: the draft needs the target feature of the last reused
        # position, which the tail prefill recomputes.
        return max(0, super()._common_prefix(row, ids) - 1)

    def generate(self, prompts, *, max_new_tokens=256, **kwargs):
        results, stats = super().generate(prompts, max_new_tokens=max_new_tokens, **kwargs)
        stats.spec_accepted = [int(x) for x in self.last_accepted] if self.last_accepted is not None else None
        return results, stats

    def _run_prefill(self, rows: list[list[int]], on_prefill) -> jax.Array:
        total = max(len(r) for r in rows)
        start = [int(n) for n in jax.device_get(self.cache.lengths)] if self.model.sparse_active else None
        c = min(self.chunk_length, max(MIN_CHUNK, 1 << (total - 1).bit_length()))
        logits = jnp.zeros((self.batch_size, self.config.vocab_size), jnp.float32)
        for begin in range(0, total, c):
            tokens = np.zeros((self.batch_size, c), np.int32)
            next_tokens = np.zeros((self.batch_size, c), np.int32)
            num_valid = np.zeros(self.batch_size, np.int32)
            draft_valid = np.zeros(self.batch_size, np.int32)
            for i, r in enumerate(rows):
                piece, following = r[begin : begin + c], r[begin + 1 : begin + c + 1]
                tokens[i, : len(piece)] = piece
                next_tokens[i, : len(following)] = following
                num_valid[i], draft_valid[i] = len(piece), len(following)
            args = (self.state, self.dstate, self.cache, self.dcache, tokens, next_tokens, num_valid, draft_valid,
                    logits, self.last_feat)
            mode = self.chunk_mode(start, begin, num_valid)
            self.cache, self.dcache, logits, self.last_feat = self._executable("spec_prefill", c, *args,
                                                                               mode=mode)(*args)
            if on_prefill is not None:
                logits.block_until_ready()
                on_prefill(min(begin + c, total), total)
        return logits

    def _decode_loop(self, ds: DecodeState, outputs, host_done, on_tokens) -> DecodeState:
        b, a = self.batch_size, self.spec.max_accept
        st = SpecState(
            dcache=self.dcache,
            pend_tok=jnp.zeros((b, a), jnp.int32).at[:, 0].set(ds.tok),
            pend_feat=jnp.zeros((b, a, self.draft.spec.feature_size), self.model.dtype).at[:, 0].set(self.last_feat),
            pend_n=jnp.where(ds.done, 0, 1).astype(jnp.int32),
            accepted=jnp.zeros((b, a + 1), jnp.int32),
        )
        pending = None
        while not all(host_done):
            args = (self.state, self.dstate, self.head, self.ids, self.cache, ds, st)
            # From the lengths (one sync a block when sparse), so rounds hold no conditional.
            mode = self.block_mode(self.cache, ds, self.decode_block * self.spec.max_accept)
            self.cache, ds, st, block = self._executable("spec_decode", None, *args, sampling=self.sampling,
                                                         mode=mode)(*args)
            if pending is not None:
                ds = self._consume(pending, outputs, host_done, on_tokens, ds)
            pending = (block, ds.done)
        self.dcache = st.dcache
        self.last_accepted = np.asarray(jax.device_get(st.accepted)).sum(axis=0)
        return ds


__all__: Sequence[str] = ("SpecConfig", "SpeculativeEngine", "compact_cache", "tree_masks")
