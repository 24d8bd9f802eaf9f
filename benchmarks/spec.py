"""The ``spec`` scenario of ``python -m benchmarks``: EAGLE speculative decoding at a known accept
length, random weights of the shape (target) and a random one-layer draft of the same layer shape.

* plain — ``Engine`` decode, ms/token (the baseline every ratio uses; bf16 unless only int4 is asked).
* verify — one target forward over an N-node tree (tree-attention kernel, logits of every node) against
  one plain decode forward (1 token), both timed as chained calls inside one jit that write their K/V in
  place into a carried cache, as the engine does: the plain engine's cache after its generate, so a sparse
  verify selects blocks from the prompt's real keys. Then each loop once more under ``jax.profiler`` (compiled
  without CUDA graphs): the forwards' kernels by name (GPU only).
* oracle — the speculative engine (``Engine`` with ``EagleSteps``) whose acceptance rule is
  :func:`oracle_accept` (``--spec_oracle_accept K``): every round accepts the draft's best chain to depth
  K-1 (so exactly K tokens a round, the work of a real round with that accept length); ms/token and the
  speed-up over plain bf16 decode.
* split — where one round of the oracle engine's own decode goes, from a ``jax.profiler`` trace of one more
  generate: each kernel of the decode program counted for its part of the round by its ``jax.named_scope``
  (``rounds.ROUND_PHASES``: draft = catch-up + tree expansion, verify = the tree's target forward + logits,
  accept = target tokens over the tree + acceptance, compact = KV compaction with the accepted path's K1/K2),
  ``other`` (stop checks, bookkeeping, fusions spanning parts) and ``idle`` (no kernel running): per round, they
  sum to the traced decode's time from its first kernel to its last. The plain engine's decode is traced the
  same way, so "verify / decode step" compares kernels of one trace kind (a trace runs without CUDA graphs:
  its idle time is longer than an untraced run's; kernel times are the same). Rounds are the traced run's own.
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
from flax import nnx
from jax import lax

from benchmarks.memory import program_memory
from benchmarks.timing import (NO_GRAPHS, carried_loop_kernels, carried_loop_time, hlo_op_paths, recompiled,
                               scoped_seconds, traced)
from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import EagleSteps
from minicpm_jax.engine.speculative.rounds import ROUND_PHASES, AcceptRule, DraftTree, SpecConfig
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


def traced_decode(engine: Engine, prompt: list[int], decode_steps: int, scopes: tuple[str, ...] = ()):
    """One more ``engine.generate`` under ``jax.profiler``: (its stats, :func:`scoped_seconds` of its decode
    program's kernels by ``scopes``: seconds over the whole decode).

    The decode program is compiled once more without CUDA graphs for it (and warmed by a generate): a
    graph's kernels reach the trace without their op paths, or not at all (H200, 2026-11-30). The kernels
    are the same; the trace's idle time is that of launches one by one, and of a host round trip for each
    round's loop condition (which a WHILE graph keeps on the device)."""
    steps = engine.steps
    with recompiled(steps, {"decode"}, NO_GRAPHS):
        engine.generate([prompt], max_new_tokens=decode_steps)
        texts = [exe.as_text() for (name, _, _), exe in steps.compiled.executables.items() if name == "decode"]
        modules = {t.split(None, 2)[1].rstrip(",") for t in texts}
        op_paths = {k: v for t in texts for k, v in hlo_op_paths(t).items()}
        (_, st), planes = traced(lambda: engine.generate([prompt], max_new_tokens=decode_steps))
    return st, scoped_seconds(planes or [], modules, scopes, op_paths=op_paths)


def _per(seconds: dict, n: float) -> dict:
    """A :func:`scoped_seconds` result in ms per ``n`` (rounds or tokens), the kernel count left out."""
    return {k: 1e3 * v / n for k, v in seconds.items() if k != "kernels"}


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
        st, traced = traced_decode(engine, prompt, decode_steps)
        per = _per(traced, st.decode_tokens)  # no scopes: every kernel is "other"
        row["traced_plain_ms_per_token"] = {"kernels": per["other"], "idle": per["idle"], "span": per["span"]}
        log(f"spec {quant}: traced plain {row['traced_plain_ms_per_token']} ms/token")
        # Issue 42's memory bound: the engine's largest program (prefill chunk, decode block) against the
        # weights + the engine's cache it runs over.
        row["program_bytes"] = program_memory(engine.steps.compiled)
        row["weights_and_cache_bytes"] = _bytes(nnx.state(model)) + _bytes(engine.cache)
        peak = max(row["program_bytes"].values(), default=0)
        print(f"  spec {quant}: largest engine program {peak / 2**30:.2f} GiB = "
              f"{peak / row['weights_and_cache_bytes']:.2f}x weights + cache "
              f"({row['weights_and_cache_bytes'] / 2**30:.2f} GiB)", file=sys.stderr)
        # Verify forward vs plain decode forward, each as the engine runs it: the new tokens' K/V written
        # in place into a carried cache, whose lengths go back after each call so every call repeats the
        # same work. The cache is the plain engine's after its last generate: the prompt's keys and compressed
        # keys, so a sparse verify's nodes select what they would in the engine (a cache of zeros past a short
        # prefill made every score tie and every node select the same blocks).
        cache = dataclasses.replace(engine.cache, lengths=jnp.asarray([context], jnp.int32))
        del engine
        gd, state = nnx.split(model)
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
        row["decode_forward_kernels_us"], carry = carried_loop_kernels(
            forward, (state, jnp.zeros((1, 1), jnp.int32), None, None), carry, iters=20)

        def time_verify(n, carry):
            depth, mask = _random_tree(n, 10)
            args = (state, jnp.zeros((1, n), jnp.int32), jnp.asarray(depth[None]), jnp.asarray(mask[None]))
            t, carry = carried_loop_time(forward, args, carry, iters=20, repeats=loop_repeats)
            kernels, carry = carried_loop_kernels(forward, args, carry, iters=20)
            return [1e3 * x for x in t], kernels, carry

        row["verify"] = []
        for n in tree_sizes:
            ms_n, kernels, carry = time_verify(n, carry)
            # Against the forward alone, and against the engine's whole decode step (ms/token of plain decode:
            # forward, sampling, stop checks), issue 42's "a decode step"; and where the forward's kernels go.
            row["verify"].append({"tree_size": n, "ms": ms_n, "vs_decode": statistics.median(ms_n) / _ms(one),
                                  "vs_decode_step": statistics.median(ms_n) / _ms(plain), "kernels_us": kernels})
            log(f"spec {quant}: verify {n} nodes {row['verify'][-1]}")

        # Oracle rounds through the speculative engine, and the split of one round.
        row["oracle"] = []
        ids = np.arange(min(frspec_vocab, config.vocab_size), dtype=np.int32) if frspec_vocab else None
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
            # Where a round goes: the same generate once more, traced (kernels by part of the round).
            st, traced = traced_decode(seng, prompt, decode_steps, ROUND_PHASES)
            rounds = st.spec_summary()["spec_rounds"]  # the traced run's own (a last round may be cut short)
            per = _per(traced, rounds)
            split = {part: per[scope] for part, scope in zip(("draft", "verify", "accept", "compact"), ROUND_PHASES)}
            split.update(other=per["other"], idle=per["idle"])
            round_ms = statistics.median(ms) * acc
            plain_kernels = row["traced_plain_ms_per_token"]["kernels"]
            row["oracle"].append({"accept": k, "draft_quant": draft_quant, "tree_size": n, "num_iter": spec.num_iter,
                                  "frspec_vocab": frspec_vocab,
                                  "ms_per_token": ms, "prefill_tok_s": prefill,
                                  "mean_accept_length": acc, "round_ms": round_ms, "split_ms": split,
                                  "traced_round_ms": per["span"],
                                  "traced_kernels_per_round": traced["kernels"] / rounds,
                                  # Issue 42's "verify ≤ 1.3× a decode step": the tree's kernels in a round against
                                  # a plain step's kernels (both traced), and against the untraced plain step.
                                  "verify_vs_decode_kernels": (split["verify"] / plain_kernels) if plain_kernels
                                  else None,
                                  "verify_vs_decode_step": split["verify"] / _ms(plain),
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
                  "plain ms/token | speed-up | vs plain dense | round ms | traced round ms: draft / verify / accept / "
                  "compact / other / idle | verify / plain step kernels |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        for o in row["oracle"]:
            s = o["split_ms"]
            ratio = "n/a" if o.get("verify_vs_decode_kernels") is None else f"{o['verify_vs_decode_kernels']:.2f}x"
            draft = {"none": "bf16", "int4": "int4"}[o.get("draft_quant", "none")]
            lines.append(f"| {row['quant']} | {draft} | {o['mean_accept_length']:.2f} | "
                         f"{o['tree_size']} ({o['frspec_vocab'] or 'all'}) | "
                         f"{statistics.median(o['ms_per_token']):.3f} | {1e3 / statistics.median(o['ms_per_token']):,.0f} | "
                         f"{statistics.median(o['prefill_tok_s']):,.0f} | {statistics.median(row['plain_ms_per_token']):.3f} | "
                         f"{o['speedup_vs_plain']:.2f}x | {o['speedup_vs_plain_bf16']:.2f}x | {o['round_ms']:.2f} | "
                         f"{o['traced_round_ms']:.2f}: {s['draft']:.2f} / {s['verify']:.2f} / {s['accept']:.3f} / "
                         f"{s['compact']:.3f} / {s['other']:.3f} / {s['idle']:.2f} | {ratio} |")
    for row in r["rows"]:  # the forwards' kernels by name (a GPU trace; absent on the CPU)
        for v in row["verify"]:
            dec, ver = row.get("decode_forward_kernels_us") or {}, v.get("kernels_us") or {}
            if not ver:
                continue
            names = sorted(set(dec) | set(ver), key=lambda n: (n == "rest", -ver.get(n, 0.0)))
            lines += ["", "Kernels by name (XLA numbers its fusions per program: one fusion may carry a "
                      "different name in each column).", "",
                      f"| {row['quant']} kernel | decode fwd µs | verify {v['tree_size']} µs |", "|---|---|---|"]
            lines += [f"| {n} | {dec.get(n, 0.0):.1f} | {ver.get(n, 0.0):.1f} |" for n in names]
            lines.append(f"| all | {sum(dec.values()):.1f} | {sum(ver.values()):.1f} |")
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
