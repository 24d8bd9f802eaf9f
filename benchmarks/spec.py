"""The ``spec`` scenario of ``python -m benchmarks``: EAGLE speculative decoding at a known accept
length, random weights of the shape (target) and a random one-layer draft of the same layer shape.

* plain — ``Engine`` decode, ms/token (the baseline every ratio uses; bf16 unless only int4 is asked).
* verify — one target forward over an N-node tree (tree-attention kernel, logits of every node) against
  one plain decode forward (1 token), both timed as chained calls inside one jit that write their K/V in
  place into a carried cache, as the engine does.
* oracle — the speculative engine (``Engine`` with ``EagleSteps``) whose acceptance rule is
  :func:`oracle_accept` (``--spec_oracle_accept K``): every round accepts the draft's best chain to depth
  K-1 (so exactly K tokens a round, the work of a real round with that accept length); ms/token and the
  speed-up over plain bf16 decode.
* split — one round's parts timed alone, each on carried caches: draft (catch-up of K pairs + tree
  expansion), verify, KV compaction (with the accepted path's K1/K2 on sparse targets); "accept" is the
  rest of the measured round (target sampling over the tree, acceptance, stop checks, bookkeeping).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import nnx

from benchmarks.memory import program_memory
from benchmarks.timing import carried_loop_time
from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import EagleSteps
from minicpm_jax.engine.speculative.rounds import (
    AcceptRule, DraftTree, SpecConfig, SpecState, catch_up, expand_tree,
)
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.policy import attention_mode
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.quant import QuantSpec


def oracle_accept(k: float, spec: SpecConfig) -> AcceptRule:
    """The benchmark's acceptance rule: every round accepts the draft's best chain down to depth ``k - 1``
    (the deepest node of depth < k with the best draft score, and its ancestors) whatever the tokens, so
    a round costs exactly what a real round with accept length ``k`` costs; the emitted tokens are the
    target's along that chain. A fractional ``k`` (CPM.cu's published 2.5) accepts ``ceil(k)`` tokens in a
    share ``k - floor(k)`` of the rounds and ``floor(k)`` in the others, picked by a hash of the round's
    draft scores and the target's token at the root (random weights often repeat one token, the scores
    still change with the position), so the mean is near ``k``; the measured mean is what a row reports."""
    lo, hi = math.floor(k), math.ceil(k)
    if not (1 <= lo and hi <= spec.max_accept):
        raise MiniCPMError(f"--spec_oracle_accept must be in 1..{spec.max_accept} (spec_num_iter + 1), got {k}")
    share = round(100 * (k - lo))

    def rule(tree: DraftTree, target, stored):
        del stored
        # Knuth's multiplicative hash of the first child's score bits and the root's target token, in 0..99.
        seed = lax.bitcast_convert_type(tree.score[:, 1].astype(jnp.float32), jnp.uint32) ^ target[:, 0].astype(jnp.uint32)
        pick = ((seed * jnp.uint32(2654435761)) >> 16) % 100 < share
        limit = jnp.where(pick, hi, lo)[:, None] - 1
        best = jnp.argmax(jnp.where(tree.depth <= limit, tree.depth * 1e6 + tree.score, -jnp.inf), axis=1)
        n = tree.tokens.shape[1]
        return jnp.take_along_axis(tree.mask, best[:, None, None], axis=1)[:, 0] | (jnp.arange(n) == 0)

    return rule


def _random_tree(n: int, topk: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Depths and ancestor masks of an n-node tree shaped like EAGLE's (root with ``topk`` children,
    deeper nodes under the first ones)."""
    parent = [0] + [0 if i <= topk else 1 + (i - topk - 1) % topk for i in range(1, n)]
    depth, mask = np.zeros(n, np.int32), np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
        mask[i] |= mask[parent[i]]
    return depth, mask


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def _ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def bench_speculative(config: ModelConfig, context: int, tree_sizes: list[int], oracle_accepts: list[float],
                      quants: list[str], group_size: int, dtype, decode_steps: int, repeats: int, make_model,
                      oracle_tree_size: int = 32, frspec_vocab: int = 32768, sparse: str = "off",
                      draft_quants: tuple[str, ...] = ("none",)) -> dict:
    """All rows of the scenario (see the module doc) at one context length, batch 1. Oracle rounds use
    ``oracle_tree_size`` nodes and an FR-Spec draft head of ``frspec_vocab`` ids (0 = the full vocabulary),
    CPM.cu's default. sparse: the target's InfLLM-v2 mode (``on``: the shape's sparse settings; every
    row, plain decoding included, then attends sparsely past ``dense_len``). draft_quants: the random
    drafts of the oracle rows, ``none`` (bf16) and/or ``int4`` (fc and layer linears int4 at ``group_size``,
    as CPM.cu's headline stack runs its QAT draft).

    make_model(config, max_length, dtype, quant=QuantSpec|None, sparse=str): the random target
    (``shapes.random_model``)."""
    max_length = context + decode_steps + 128
    prompt = list(np.random.default_rng(0).integers(0, config.vocab_size, context))
    started = time.perf_counter()

    def log(msg):  # progress with the seconds since the start: where a long 128K run spends its time
        print(f"  [{time.perf_counter() - started:.0f}s] {msg}", file=sys.stderr, flush=True)

    # The verify / decode loops are short (20 forwards): time each at least 3 times, so that one slow run
    # shows as an outlier beside the median instead of being the row.
    loop_repeats = max(3, repeats)
    out: dict = {"context": context, "sparse": sparse, "draft_quants": list(draft_quants), "rows": []}
    plain_bf16 = None
    for quant in sorted(quants, key=lambda q: q != "none"):  # the dense baseline first, whatever the flag order
        spec_q = QuantSpec(group_size=group_size) if quant == "int4" else None
        model = make_model(config, max_length, dtype, quant=spec_q, sparse=sparse)
        drafts = {dq: EagleDraft(DraftSpec.for_target(config), max_length=max_length,
                                 attention_impl=model.attention_impl, dtype=dtype, rngs=nnx.Rngs(1),
                                 quant=QuantSpec(group_size=group_size) if dq == "int4" else None)
                  for dq in draft_quants}
        # Plain decode through the engine.
        engine = Engine(model, batch_size=1, chunk_length=1024, decode_block=32)
        engine.generate([prompt], max_new_tokens=decode_steps)
        plain, plain_prefill = [], []
        for _ in range(repeats):
            _, st = engine.generate([prompt], max_new_tokens=decode_steps)
            plain.append(st.decode_time / st.decode_tokens)
            plain_prefill.append(st.prefill_tokens_per_s)
        if plain_bf16 is None:  # dense weights, or int4 when only int4 is asked
            plain_bf16 = _ms(plain)
        row = {"quant": quant, "plain_ms_per_token": [1e3 * t for t in plain], "plain_prefill_tok_s": plain_prefill}
        log(f"spec {quant}: plain {row['plain_ms_per_token']} ms/token")
        # Issue 42's memory bound: the engine's largest program (prefill chunk, decode block) against the
        # weights + the engine's cache it runs over.
        row["program_bytes"] = program_memory(engine.steps.compiled)
        row["weights_and_cache_bytes"] = _bytes(nnx.state(model)) + _bytes(engine.cache)
        peak = max(row["program_bytes"].values(), default=0)
        print(f"  spec {quant}: largest engine program {peak / 2**30:.2f} GiB = "
              f"{peak / row['weights_and_cache_bytes']:.2f}x weights + cache "
              f"({row['weights_and_cache_bytes'] / 2**30:.2f} GiB)", file=sys.stderr)
        del engine  # its cache: the rows below carry one of their own

        # Verify forward vs plain decode forward, each as the engine runs it: the new tokens' K/V written
        # in place into a carried cache, whose lengths go back after each call so every call repeats the
        # same work (stale K/V: cost only).
        gd, state = nnx.split(model)
        cache = model.new_cache(1)
        _, _, cache = model(jnp.asarray([prompt[:1024]]), cache)
        cache = dataclasses.replace(cache, lengths=jnp.asarray([context], jnp.int32))
        carry = (cache, jnp.zeros((), jnp.float32))

        def forward(state, tokens, depth, mask, carry):
            c, probe = carry
            m = nnx.merge(gd, state)
            tree = None if depth is None else (depth, mask)
            # The static mode the engine would compile for these lengths (auto would run a tree both ways).
            mode = (attention_mode(model.sparse.dense_len, context + 1, context + tokens.shape[1])
                    if model.sparse_active else "auto")
            logits, _, c2 = m(tokens, c, mode=mode, tree=tree)
            return dataclasses.replace(c2, lengths=c.lengths), probe + logits[0, -1, 0].astype(jnp.float32)

        one, carry = carried_loop_time(forward, (state, jnp.zeros((1, 1), jnp.int32), None, None), carry, iters=20,
                                       repeats=loop_repeats)
        row["decode_forward_ms"] = [1e3 * t for t in one]

        def time_verify(n, carry):
            depth, mask = _random_tree(n, 10)
            args = (state, jnp.zeros((1, n), jnp.int32), jnp.asarray(depth[None]), jnp.asarray(mask[None]))
            t, carry = carried_loop_time(forward, args, carry, iters=20, repeats=loop_repeats)
            return [1e3 * x for x in t], carry

        row["verify"] = []
        for n in tree_sizes:
            ms_n, carry = time_verify(n, carry)
            # Against the forward alone, and against the engine's whole decode step (ms/token of plain decode:
            # forward, sampling, stop checks), issue 42's "a decode step".
            row["verify"].append({"tree_size": n, "ms": ms_n, "vs_decode": statistics.median(ms_n) / _ms(one),
                                  "vs_decode_step": statistics.median(ms_n) / _ms(plain)})
            log(f"spec {quant}: verify {n} nodes {row['verify'][-1]}")

        # Oracle rounds through the speculative engine, and the split of one round.
        row["oracle"] = []
        ids = np.arange(min(frspec_vocab, config.vocab_size), dtype=np.int32) if frspec_vocab else None
        head = None if ids is None else model.head_rows(jnp.asarray(ids))
        for (draft_quant, draft), k in itertools.product(drafts.items(), oracle_accepts):
            n = oracle_tree_size
            spec = SpecConfig(num_iter=max(2, math.ceil(k) - 1), topk_per_iter=10, tree_size=n)
            steps = EagleSteps(model, draft, spec=spec, frspec_ids=ids, batch_size=1, decode_block=8,
                               accept=oracle_accept(k, spec))
            seng = Engine(model, batch_size=1, chunk_length=1024, decode_block=8, steps=steps)
            seng.generate([prompt], max_new_tokens=decode_steps)
            ms, acc, prefill = [], None, []
            for _ in range(repeats):
                _, st = seng.generate([prompt], max_new_tokens=decode_steps)
                ms.append(1e3 * st.decode_time / st.decode_tokens)
                prefill.append(st.prefill_tokens_per_s)
                acc = st.spec_summary()["mean_accept_length"]
            dgd, dstate = nnx.split(draft)
            a = spec.max_accept
            st0 = SpecState(dcache=dataclasses.replace(draft.new_cache(1, max_length + spec.draft_slots + a),
                                                       lengths=jnp.asarray([context], jnp.int32)),
                            pend_tok=jnp.zeros((1, a), jnp.int32), pend_feat=jnp.zeros((1, a, draft.spec.feature_size), dtype),
                            pend_n=jnp.asarray([k], jnp.int32), accepted=jnp.zeros((1, a + 1), jnp.int32))
            head_, ids_ = head, None if ids is None else jnp.asarray(ids)

            def draft_part(state, dstate, st0, carry):
                # The round's draft work on a carried draft cache, as run_round keeps it.
                dc, probe = carry
                m, d = nnx.merge(gd, state), nnx.merge(dgd, dstate)
                h, dc2 = catch_up(m, d, dataclasses.replace(st0, dcache=dc), spec.window_size or None)
                tok, _, _, score, dc2 = expand_tree(m, d, dc2, h, head_, ids_, spec, spec.window_size or None)
                return dataclasses.replace(dc2, lengths=dc.lengths), probe + score[0, 0] + tok[0, -1]

            t_draft, _ = carried_loop_time(draft_part, (state, dstate, dataclasses.replace(st0, dcache=None)),
                                           (st0.dcache, jnp.zeros((), jnp.float32)), iters=20, repeats=loop_repeats)

            def compact_part(state, path, carry):
                # The accepted path moved into place and its compressed keys appended, as run_round does.
                c, probe = carry
                m = nnx.merge(gd, state)
                c2 = c.commit_path(c.lengths, path, jnp.asarray([k], jnp.int32))
                c2 = m.extend_compressed(c2, c.lengths, c2.lengths, a)
                return dataclasses.replace(c2, lengths=c.lengths), probe

            path = jnp.asarray([list(range(a))], jnp.int32)
            t_compact, carry = carried_loop_time(compact_part, (state, path), carry, iters=20, repeats=loop_repeats)
            verify_ms = next((v["ms"] for v in row["verify"] if v["tree_size"] == n), None)
            if verify_ms is None:
                verify_ms, carry = time_verify(n, carry)
            round_ms = statistics.median(ms) * acc
            split = {"draft": _ms(t_draft), "verify": statistics.median(verify_ms), "compact": _ms(t_compact)}
            split["accept_and_rest"] = round_ms - sum(split.values())
            row["oracle"].append({"accept": k, "draft_quant": draft_quant, "tree_size": n, "num_iter": spec.num_iter,
                                  "frspec_vocab": frspec_vocab,
                                  "ms_per_token": ms, "prefill_tok_s": prefill,
                                  "mean_accept_length": acc, "round_ms": round_ms, "split_ms": split,
                                  "speedup_vs_plain": _ms(plain) / statistics.median(ms),
                                  "speedup_vs_plain_bf16": plain_bf16 / statistics.median(ms)})
            o = row["oracle"][-1]
            o["program_bytes"] = program_memory(seng.steps.compiled)
            o["weights_and_caches_bytes"] = (_bytes(nnx.state(model)) + _bytes(nnx.state(draft)) + _bytes(seng.cache)
                                             + _bytes(seng.steps.dcache))
            log(f"spec {quant}: oracle {o}")
            del seng
        # The device's peak so far (this row's programs and the rows before it; None off the GPU).
        row["peak_bytes_in_use"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        print(f"  spec {quant}: device peak {row['peak_bytes_in_use']} bytes", file=sys.stderr)
        out["rows"].append(row)
        model = drafts = draft = None  # free this row's weights before the next row's
    out["plain_bf16_ms_per_token"] = plain_bf16
    return out


def spec_markdown(r: dict) -> str:
    sparse = ", InfLLM-v2 sparse attention" if r.get("sparse") == "on" else ""
    lines = [f"Speculative decoding (EAGLE-2 trees, batch 1, context {r['context']}{sparse}, random weights; "
             f"plain dense-weight decode {r['plain_bf16_ms_per_token']:.3f} ms/token)", "",
             "| weights | tree | verify ms | plain decode fwd ms | verify / decode fwd | verify / decode step |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        for v in row["verify"]:
            step = f"{v['vs_decode_step']:.2f}x" if "vs_decode_step" in v else "n/a"
            lines.append(f"| {row['quant']} | {v['tree_size']} | {statistics.median(v['ms']):.3f} | "
                         f"{statistics.median(row['decode_forward_ms']):.3f} | {v['vs_decode']:.2f}x | {step} |")
    lines += ["", "| weights | draft | oracle accept | tree (FR-Spec ids) | ms/token | tok/s | prefill tok/s | "
                  "plain ms/token | speed-up | vs plain dense | round ms: draft / verify / compact / accept+rest |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        for o in row["oracle"]:
            s = o["split_ms"]
            draft = {"none": "bf16", "int4": "int4"}[o.get("draft_quant", "none")]
            lines.append(f"| {row['quant']} | {draft} | {o['mean_accept_length']:.2f} | "
                         f"{o['tree_size']} ({o['frspec_vocab'] or 'all'}) | "
                         f"{statistics.median(o['ms_per_token']):.3f} | {1e3 / statistics.median(o['ms_per_token']):,.0f} | "
                         f"{statistics.median(o['prefill_tok_s']):,.0f} | {statistics.median(row['plain_ms_per_token']):.3f} | "
                         f"{o['speedup_vs_plain']:.2f}x | {o['speedup_vs_plain_bf16']:.2f}x | {o['round_ms']:.2f}: "
                         f"{s['draft']:.2f} / {s['verify']:.2f} / {s['compact']:.3f} / {s['accept_and_rest']:.2f} |")
    lines += ["", "| weights | engine | largest program GiB (which) | weights + caches GiB | ratio |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        runs = [("plain", row.get("program_bytes"), row.get("weights_and_cache_bytes"))]
        runs += [(f"speculative, accept {o['accept']}" + (", int4 draft" if o.get("draft_quant") == "int4" else ""),
                  o.get("program_bytes"), o.get("weights_and_caches_bytes")) for o in row["oracle"]]
        for what, programs, base in runs:
            if programs:
                name, peak = max(programs.items(), key=lambda kv: kv[1])
                lines.append(f"| {row['quant']} | {what} | {peak / 2**30:.2f} ({name}) | {base / 2**30:.2f} | "
                             f"{peak / base:.2f}x |")
    return "\n".join(lines)
