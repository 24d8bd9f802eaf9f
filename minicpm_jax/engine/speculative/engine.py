"""The speculative engine: an :class:`~minicpm_jax.engine.engine.Engine` whose device programs are EAGLE
rounds (:class:`EagleSteps`) instead of plain decode steps. The engine's host logic (prompt checks,
prefix reuse, chunked prefill, streaming, stops, stats) is the plain engine's; only the step set differs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from minicpm_jax.engine.engine import Engine, set_lengths, split_over
from minicpm_jax.engine.paging import Paging
from minicpm_jax.engine.speculative.rounds import (
    AcceptRule,
    SpecConfig,
    SpecState,
    match_target,
    spec_block,
    spec_prefill_chunk,
    spec_prefill_rows,
)
from minicpm_jax.engine.steps import Compiled, PrefillChunk, first_token, sum_rows
from minicpm_jax.engine.stops import DecodeState, loop_conditions_on_device
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.policy import tree_depth_limit
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.paged_cache import PagedKVCache
from minicpm_jax.model.parallel import REPLICATED, replicate, spmd


class EagleSteps:
    """The device programs of EAGLE-2 speculative decoding (the step set of
    :class:`~minicpm_jax.engine.steps.PlainSteps`' interface): a prompt chunk through the target and then
    its (feature, next token) pairs through the draft; the first token; ``decode_block`` rounds per block.

    Args:
      model: the target. draft: its :class:`~minicpm_jax.model.draft.EagleDraft` (same dtype).
      spec: tree settings. frspec_ids: FR-Spec subset ``int32[V']`` (``minicpm_jax.io.frspec.read_frspec``),
        or None. batch_size: the engine's slots. decode_block: rounds per block.
      accept: the acceptance rule of the rounds (default :func:`~minicpm_jax.engine.speculative.rounds.match_target`,
        the target's tokens).
      page_size, num_pages: the target's cache is a paged pool of ``num_pages`` pages of ``page_size``
        positions (None: contiguous); the draft's cache is then a one-layer pool of the same pages, viewed
        through the target's page table, so a page shared by prefix brings the draft's pairs too (pair
        ``t = (feature_t, token_{t+1})`` sits at position ``t``: a page's last pair depends on the token
        after it, and the last round's pairs wait unread: a prompt computes the last page of a cached prefix
        again, ``reuse_margin``).
    Sparse (InfLLM-v2) targets verify each tree node as plain sparse decoding of its path would, and extend
    the compressed keys by the accepted tokens (trees at most
    :func:`~minicpm_jax.infllm.policy.tree_depth_limit` deep). With a target split over a mesh the draft,
    its cache and the FR-Spec head are replicated on every device.
    """

    has_logprobs = False  # a round's tokens come from several nodes' logits; none are reported
    # Rounds run every slot: a subset of rows would copy a contiguous draft cache's rows (over pages taking
    # rows is free; not done yet).
    decodes_rows = False

    def __init__(self, model: MiniCPMForCausalLM, draft: EagleDraft, *, spec: SpecConfig = SpecConfig(),
                 frspec_ids: np.ndarray | None = None, batch_size: int = 1, decode_block: int = 4,
                 accept: AcceptRule = match_target, page_size: int | None = None, num_pages: int | None = None):
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
        if model.max_length < 16:
            raise MiniCPMError(f"speculative decoding needs max_length >= 16, got {model.max_length}")
        if model.sparse_active and spec.num_iter > tree_depth_limit(model.sparse):
            raise MiniCPMError(
                f"spec_num_iter {spec.num_iter} is deeper than sparse attention verifies exactly with this sparse_config "
                f"(at most {tree_depth_limit(model.sparse)}: shorter than the coarse stride, inside the local window)")
        self.model, self.draft = model, draft
        self.page_size, self.num_pages = page_size, num_pages
        # Tokens of a reused prefix computed again: the draft holds the pairs of all but its last positions
        # (up to max_accept - 1 pairs of the last round wait unread, and the pair of the last reused
        # position needs the token after it).
        self.reuse_margin = self.spec.max_accept
        if page_size is not None and self.reuse_margin > page_size:
            raise MiniCPMError(f"speculative rounds of up to {self.spec.max_accept} tokens need pages of at least as "
                               f"many tokens, got {page_size}")
        mesh = model.mesh
        self.graphdef, self.state = nnx.split(model)
        self.dgraph, self.dstate = nnx.split(draft)
        if mesh is not None:  # the draft module then holds the replicated arrays (no second copy)
            self.dstate = replicate(mesh, self.dstate)
            nnx.update(draft, self.dstate)
        self.ids = None if frspec_ids is None else replicate(mesh, jnp.asarray(frspec_ids, jnp.int32))
        self.head = None if frspec_ids is None else replicate(mesh, model.head_rows(self.ids))
        self.batch_size = batch_size
        self.tokens_per_block = decode_block * spec.max_accept
        self.dcache = self._new_draft_cache()
        self.last_feat = jnp.zeros((batch_size, draft.spec.feature_size), model.dtype)
        self.rounds: SpecState | None = None  # the state carried between decode blocks
        g, dg = self.graphdef, self.dgraph
        s, c, r = model.param_specs(self.state), model.cache_specs(page_size), REPLICATED
        # prefill(state, dstate, cache, dcache, tokens, next_tokens, num_valid, next_valid, logits, last_feat)
        prefill = spmd(mesh, functools.partial(spec_prefill_chunk, g, dgraph=dg),
                       (s, r, c, r, r, r, r, r, r, r), (c, r, r, r))
        # decode(state, dstate, head, ids, cache, ds, st)
        decode = spmd(mesh, functools.partial(spec_block, g, dgraph=dg, rounds=decode_block, spec=self.spec,
                                              accept=accept,
                                              check_each=loop_conditions_on_device(1 if mesh is None else mesh.size)),
                      (s, r, r, r, c, r, r), (c, r, r, r))
        # prefill_rows(state, dstate, cache, dcache, idx, tokens, next_tokens, num_valid, next_valid, last_feat)
        rows = spmd(mesh, functools.partial(spec_prefill_rows, g, dgraph=dg), (s, r, c, r, r, r, r, r, r, r),
                    (c, r, r, r))
        self.compiled = Compiled({
            "prefill": jax.jit(prefill, donate_argnums=(2, 3), static_argnames="mode"),
            "prefill_rows": jax.jit(rows, donate_argnums=(2, 3), static_argnames="mode"),
            "first": jax.jit(functools.partial(first_token, max_length=model.max_length), static_argnames="sampling"),
            "decode": jax.jit(decode, donate_argnums=(4, 6), static_argnames=("sampling", "mode")),
        }, few_rows=frozenset({"decode"}))

    @property
    def compile_time(self) -> float:
        return self.compiled.compile_time

    def reset(self, rows: np.ndarray | None = None) -> None:
        """Forgets the draft's cached pairs (of the slots ``rows``, or all; a fresh cache if an interrupted
        step left it donated) and those slots' pending pairs (a slot reused mid-batch must not replay its
        last owner's)."""
        if rows is None and self.dcache.is_deleted():
            self.dcache = self._new_draft_cache()
        else:
            self.dcache = self.dcache.reset(None if rows is None else jnp.asarray(rows))
        if self.rounds is not None:
            keep = jnp.zeros(self.batch_size, bool) if rows is None else ~jnp.asarray(rows)
            self.rounds = dataclasses.replace(self.rounds, dcache=self.dcache,
                                              pend_n=jnp.where(keep, self.rounds.pend_n, 0))

    def _new_draft_cache(self) -> KVCache | PagedKVCache:
        """An empty draft cache: a row of the target's length plus a tree's slots per slot, or a paged pool
        beside the target's."""
        if self.page_size is None:
            return self.draft.new_cache(self.batch_size, self.model.max_length + self.spec.draft_slots +
                                        self.spec.max_accept)
        return self.draft.new_paged_cache(num_pages=self.num_pages, page_size=self.page_size,
                                          batch_size=self.batch_size, max_length=self.model.max_length)

    def admitted(self, slot: int, length: int) -> None:
        """``slot`` shares a cached prefix of ``length`` tokens: the draft's pairs before it are in the shared
        pages (the pair of its last position too: the prefix cache keeps ``reuse_margin`` back)."""
        self.dcache = self.dcache.with_lengths(set_lengths(self.dcache.lengths, np.int32(slot), np.int32(length)))

    def truncate(self, lengths: Sequence[int]) -> None:
        # Draft pair t = (f_t, x_{t+1}) is valid while x_{t+1} is cached; the tail prefill restarts at the
        # length, so the draft holds exactly the pairs before it.
        self.dcache = self.dcache.with_lengths(lengths)

    def prefill_chunk(self, cache: KVCache, chunk: PrefillChunk, logits: jax.Array, mode: str):
        args = (self.state, self.dstate, cache, self.dcache, chunk.tokens, chunk.next_tokens, chunk.num_valid,
                chunk.next_valid, logits, self.last_feat)
        cache, self.dcache, logits, self.last_feat = self.compiled("prefill", chunk.tokens.shape[1], *args, mode=mode)
        return cache, logits

    def prefill_rows(self, cache: KVCache, idx: np.ndarray, chunk: PrefillChunk, mode: str):
        """Runs the rows ``idx int32[b]`` of ``chunk`` over those slots' target and draft cache rows alone
        (the others are neither computed nor changed); returns (cache, last-token logits ``f32[B, V]``,
        zeros elsewhere)."""
        args = (self.state, self.dstate, cache, self.dcache, idx, chunk.tokens[idx], chunk.next_tokens[idx],
                chunk.num_valid[idx], chunk.next_valid[idx], self.last_feat)
        cache, self.dcache, logits, self.last_feat = self.compiled("prefill_rows", (len(idx), chunk.tokens.shape[1]),
                                                                   *args, mode=mode)
        return cache, logits

    def first_token(self, cache: KVCache, ds: DecodeState, logits: jax.Array, active: jax.Array,
                    sampling: str = "auto", logprobs: int = 0) -> DecodeState:
        self._no_logprobs(logprobs)
        args = (ds, logits, active, cache.lengths)
        return self.compiled("first", None, *args, sampling=sampling)

    def start(self, ds: DecodeState, rows: jax.Array | None = None) -> None:
        """Rounds begin: the draft has yet to read the pair (last prompt feature, first token) of each row
        (of the rows ``bool[B]`` only, when given: rows joining a running batch; the others keep their
        pending pairs and every row its accept counts)."""
        b, a = self.batch_size, self.spec.max_accept
        fresh = SpecState(
            dcache=self.dcache,
            pend_tok=jnp.zeros((b, a), jnp.int32).at[:, 0].set(ds.tok),
            pend_feat=jnp.zeros((b, a, self.draft.spec.feature_size), self.model.dtype).at[:, 0].set(self.last_feat),
            pend_n=jnp.where(ds.done, 0, 1).astype(jnp.int32),
            accepted=jnp.zeros((b, a + 1), jnp.int32),
        )
        if rows is None or self.rounds is None:
            self.rounds = fresh
            return
        pick = lambda new, old: jnp.where(rows.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
        self.rounds = SpecState(dcache=self.dcache, pend_tok=pick(fresh.pend_tok, self.rounds.pend_tok),
                                pend_feat=pick(fresh.pend_feat, self.rounds.pend_feat),
                                pend_n=pick(fresh.pend_n, self.rounds.pend_n), accepted=self.rounds.accepted)

    def decode_block(self, cache: KVCache, ds: DecodeState, mode: str, sampling: str = "auto", logprobs: int = 0,
                     rows: np.ndarray | None = None):
        """``decode_block`` rounds; returns (cache, state, tokens ``int32[B, rounds·A]``, -1 = none). ``rows``
        is a hint this step set does not take: rounds run over every slot (the finished ones masked), as the
        draft's contiguous cache would have to copy a subset's rows."""
        self._no_logprobs(logprobs)
        # The draft cache as prefill and reset left it (they replace it; the rounds' copy may be donated).
        args = (self.state, self.dstate, self.head, self.ids, cache, ds, dataclasses.replace(self.rounds, dcache=self.dcache))
        cache, ds, self.rounds, tokens = self.compiled("decode", None, *args, sampling=sampling, mode=mode)
        self.dcache = self.rounds.dcache
        return cache, ds, tokens

    @staticmethod
    def _no_logprobs(logprobs: int) -> None:
        if logprobs:
            raise MiniCPMError("speculative rounds do not return log-probabilities")

    def accept_counts(self) -> jax.Array | None:
        """Rounds by the tokens they emitted (0, 1, ..., A), summed over the rows since decoding began, as a
        new device array ``int32[A + 1]`` (later rounds do not donate it); None before the first round."""
        return None if self.rounds is None else sum_rows(self.rounds.accepted)

    def accepted(self) -> np.ndarray | None:
        """Rounds of the last decode loop by tokens emitted (0, 1, ..., A), summed over the rows."""
        return None if self.rounds is None else np.asarray(jax.device_get(self.rounds.accepted)).sum(axis=0)


class SpeculativeEngine(Engine):
    """:class:`Engine` whose decode runs EAGLE-2 speculative rounds (:class:`EagleSteps`).

    Args:
      model: the target. draft: its :class:`~minicpm_jax.model.draft.EagleDraft` (same dtype).
      spec: tree settings. frspec_ids: FR-Spec subset ``int32[V']``, or None.
      decode_block: rounds per host round trip. Other arguments as :class:`Engine` (with ``mesh`` the draft
      is replicated on every device).
    """

    def __init__(self, model: MiniCPMForCausalLM, draft: EagleDraft, *, spec: SpecConfig = SpecConfig(),
                 frspec_ids: np.ndarray | None = None, batch_size: int = 1, chunk_length: int = 256,
                 decode_block: int = 4, mesh: Mesh | None = None, scratch_rows: int = 1, paging: Paging | None = None):
        model = split_over(model, mesh)
        steps = EagleSteps(model, draft, spec=spec, frspec_ids=frspec_ids, batch_size=batch_size,
                           decode_block=decode_block, page_size=None if paging is None else paging.page_size,
                           num_pages=None if paging is None else paging.num_pages)
        super().__init__(model, batch_size=batch_size, chunk_length=chunk_length, decode_block=decode_block,
                         steps=steps, scratch_rows=scratch_rows, paging=paging)

    @property
    def spec(self) -> SpecConfig:
        return self.steps.spec

    @property
    def draft(self) -> EagleDraft:
        return self.steps.draft

    @property
    def frspec_ids(self) -> jax.Array | None:
        """The FR-Spec subset the draft's head runs over, or None."""
        return self.steps.ids
