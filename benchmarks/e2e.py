"""The ``e2e`` scenario: the real engine (chunked prefill, on-device decode loop) on a model shape with
random weights — decode ms/token against (weights + valid K/V bytes) / copy bandwidth, prefill tok/s
against FLOPs per token / matmul FLOP/s — and the HF transformers peer rows beside it. With tensor
parallelism each device reads its share, so the roofline is that share over one device's copy bandwidth,
and each row also gives its speed-up over the one-device row and (``profile_collectives``) the time its
all-reduces take per layer, from a profile of the decode loop."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.memory import program_memory
from benchmarks.shapes import SHAPES, decode_weight_bytes, prefill_flops_per_token, random_model
from benchmarks.timing import NO_LOOP_GRAPHS, gpu_timeline, kernel_seconds, recompiled, traced
from minicpm_jax.config import ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.paging import DEFAULT_PAGE_SIZE, Paging
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.paged_cache import PagedKVCache
from minicpm_jax.model.parallel import TensorParallel, make_mesh, set_all_reduce
from minicpm_jax.quant import QuantSpec


@dataclasses.dataclass
class Row:
    shape: str
    attention_impl: str
    quant: str
    context: int
    batch_size: int
    max_length: int
    prefill_tok_s: list[float]
    decode_ms_per_token: list[float]
    roofline_ms: float
    prefill_roofline_tok_s: float
    sparse: str = "off"
    cache_bytes: int = 0
    peak_bytes: int | None = None
    tensor_parallel: int = 1
    spmd: bool = False  # the SPMD (sharded) program, also at size 1
    allreduce_us_per_layer: float | None = None  # profiled collective kernel time per decode step / layers
    kernel_ms_per_step: float | None = None  # profiled GPU kernel time per decode step (one device), all kernels
    top_kernels_us_per_step: dict | None = None  # the profile's longest kernels (one device), µs per decode step
    kv_cache: str = "contiguous"  # or "paged": the server's pool of pages
    gpu_timeline_per_step: dict | None = None  # profiled, one device: span / busy / gaps ms and launches a step
    program_bytes: int | None = None  # the engine's largest program: arguments + outputs + temporaries

    @property
    def decode_ms(self) -> float:
        return statistics.median(self.decode_ms_per_token)

    @property
    def pct_roofline(self) -> float:
        return 100 * self.roofline_ms / self.decode_ms


def decode_hlo(engine: Engine, mode: str = "dense") -> str:
    """Optimized HLO of the engine's decode block (its own program, compiled again here, for performance work)."""
    steps = engine.steps
    fn = steps.compiled.jitted["decode"]
    return fn.lower(steps.state, engine.cache, engine.decode_state([], [], []), mode=mode,
                    sampling="auto").compile(steps.compiled.options("decode")).as_text()


# NCCL's kernels, and XLA's own all-reduce kernels (fused psums, "__triton_collective" fusions).
COLLECTIVE_KERNEL = re.compile(r"nccl|all_?reduce|allreduce|all-reduce|psum|all_?gather|collective", re.IGNORECASE)


def profiled_decode(engine: Engine, prompts, decode_steps: int) -> dict | None:
    """Per decode step on the first device, from two profiled ``generate`` calls (``PROFILE_BASE`` and
    ``PROFILE_BASE + decode_steps`` tokens; their difference drops the prefill and the first steps):
    ``kernels`` seconds by kernel name, and the timeline's ``span_s`` (first kernel start to last kernel
    end), ``busy_s`` (union of kernel intervals), ``gaps_s`` / ``gaps`` (idle stretches over 3 µs),
    ``launches``. None without GPU kernels in the traces (the CPU).

    The decode program is compiled for the traces with CUDA graphs for everything but loops
    (:func:`~benchmarks.timing.recompiled` with :data:`~benchmarks.timing.NO_LOOP_GRAPHS`): a WHILE graph's
    kernels mostly never reach the trace (a TP 1 decode counted 18 launches a step), while those of a step's
    graphs do, by name. Without any graph (as the spec split traces, for op paths) a split model's all-reduce
    kernels would count the GPUs' drift as they wait for each other: 3.6 ms a step of an int4 TP 2 decode
    against 0.37 ms with the step's graphs (2x H200, 2026-11-30)."""
    with recompiled(engine.steps, {"decode"}, NO_LOOP_GRAPHS):
        engine.generate(prompts, max_new_tokens=2)
        short, long = (traced(lambda n=n: engine.generate(prompts, max_new_tokens=PROFILE_BASE + n))[1]
                       for n in (0, decode_steps))
    if short is None or long is None:
        return None
    k_short, k_long = kernel_seconds(short, device=0), kernel_seconds(long, device=0)
    if not k_long:
        return None
    t_short, t_long = gpu_timeline(short, 0), gpu_timeline(long, 0)
    per = {k: (t - k_short.get(k, 0.0)) / decode_steps for k, t in k_long.items()}
    out = {"kernels": {k: v for k, v in per.items() if v > 0}}
    for key in ("span_s", "busy_s", "gaps_s", "gaps"):
        out[key] = (t_long[key] - t_short[key]) / decode_steps
    out["launches"] = (t_long["kernels"] - t_short["kernels"]) / decode_steps
    return out


PROFILE_BASE = 8  # tokens of the shorter profiled call


def bench_end_to_end(shape: str, contexts: list[int], batch_size: int, decode_steps: int, decode_block: int,
                     chunk_length: int, dtype, repeats: int, bandwidth: float, flops: float,
                     max_length: int | None = None, dump_hlo: str | None = None,
                     attention_impl: str = "auto", quant: QuantSpec | None = None, sparse: str = "off",
                     tensor_parallel: int = 1, spmd: bool = False, profile_collectives: bool = False,
                     kv_cache: str = "contiguous", all_reduce: str = "xla") -> list[Row]:
    """Rows of one model (shape, weights, kernels, sparse mode) split over ``tensor_parallel`` devices
    (``spmd``: through the sharded program even at size 1) at each context; ``kv_cache`` ``paged`` runs the
    engine over a pool of 64-token pages just large enough for the batch (as the server does, page tables
    and all); ``all_reduce``: a split model's all-reduce (``--tp_all_reduce``: auto, peer, xla, nccl)."""
    config = ModelConfig.from_dict(SHAPES[shape])
    max_length = max_length or max(contexts) + decode_steps + 8
    if max_length < max(contexts) + decode_steps:
        raise MiniCPMError(f"--max_length {max_length} is too small for context {max(contexts)} + {decode_steps} steps")
    tp = TensorParallel.of(config, tensor_parallel, quant)
    mesh = make_mesh(tensor_parallel) if tensor_parallel > 1 or spmd else None
    note = set_all_reduce(mesh, all_reduce) if tensor_parallel > 1 else None
    if note:
        print(f"note: {note}", file=sys.stderr)
    model = random_model(config, max_length, dtype, attention_impl, quant, sparse, mesh=mesh)
    impl = model.attention_impl
    cache_bytes = KVCache.nbytes(config, batch_size, max_length, dtype, model.sparse, kv_heads=tp.stored_kv_heads) // tp.size
    qname = "none" if quant is None else f"int4 g{quant.group_size}"
    paging = None
    if kv_cache == "paged":
        paging = Paging(num_pages=batch_size * -(-max_length // DEFAULT_PAGE_SIZE))
        cache_bytes = PagedKVCache.nbytes(config, paging.num_pages, paging.page_size, batch_size, dtype,
                                          kv_heads=tp.stored_kv_heads, sparse=model.sparse) // tp.size
    elif kv_cache != "contiguous":
        raise MiniCPMError(f"--kv_caches takes contiguous and paged, got {kv_cache!r}")
    engine = Engine(model, batch_size=batch_size, chunk_length=min(chunk_length, max_length), decode_block=decode_block,
                    paging=paging)
    itemsize = jnp.dtype(dtype).itemsize
    wbytes = decode_weight_bytes(config, itemsize, quant) / tp.size  # each device reads its share
    rng = np.random.default_rng(0)
    rows = []
    for ctx in contexts:
        prompts = [list(rng.integers(0, config.vocab_size, ctx)) for _ in range(batch_size)]
        engine.generate(prompts, max_new_tokens=decode_steps)  # compile + warm up
        if dump_hlo:
            with open(dump_hlo, "w") as f:
                f.write(decode_hlo(engine))
            dump_hlo = None
        pre, dec = [], []
        for _ in range(repeats):
            results, stats = engine.generate(prompts, max_new_tokens=decode_steps)
            assert all(len(r.token_ids) == decode_steps for r in results)
            pre.append(stats.prefill_tokens_per_s)
            dec.append(1e3 * stats.decode_time / (decode_steps - 1))  # per step (all rows advance together)
        # The least KV a step must read is the valid context (the xla path reads all max_length slots); a
        # device reads its KV heads (copies included).
        kv_bytes = 2 * config.num_layers * batch_size * tp.kv_heads * ctx * config.head_dim * itemsize
        roofline_ms = 1e3 * (wbytes + kv_bytes) / bandwidth
        prefill_roof = tp.size * flops / prefill_flops_per_token(config, ctx)
        stats = jax.devices()[0].memory_stats() or {}
        allreduce = kernels = top = timeline = None
        if profile_collectives:
            prof = profiled_decode(engine, prompts, decode_steps)
            if prof is not None:
                per_kernel = prof["kernels"]
                # 2 per layer (o_proj, down_proj) + the embedding; the logits' gather is counted in too.
                comm = sum(t for name, t in per_kernel.items() if COLLECTIVE_KERNEL.search(name))
                allreduce = 1e6 * comm / config.num_layers if tp.size > 1 else None
                kernels = 1e3 * sum(per_kernel.values())
                top = {k: 1e6 * t for k, t in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:60]}
                timeline = {k: (1e3 * v if k.endswith("_s") else v) for k, v in prof.items() if k != "kernels"}
                print("  longest kernels, us/step: " + "; ".join(f"{k[:60]} {v:.0f}" for k, v in list(top.items())[:15]),
                      file=sys.stderr)
                print("  GPU 0 per step: " + ", ".join(f"{k.replace('_s', ' ms')} {v:.3f}" for k, v in timeline.items()),
                      file=sys.stderr)
        largest = max(program_memory(engine.steps.compiled).values(), default=None)
        rows.append(Row(shape, impl, qname, ctx, batch_size, max_length, pre, dec, roofline_ms, prefill_roof, sparse,
                        cache_bytes, stats.get("peak_bytes_in_use"), tp.size, mesh is not None, allreduce, kernels,
                        top, kv_cache, timeline, largest))
        print(f"  {shape} {impl} {qname} sparse={sparse} tp={tp.size}{' spmd' if mesh is not None else ''} "
              f"kv={kv_cache} ctx={ctx}: "
              f"decode {dec} ms/token (roofline {roofline_ms:.3f} ms), prefill {pre} tok/s"
              + (f", collectives {allreduce:.1f} us/layer" if allreduce is not None else "")
              + (f", kernels {kernels:.3f} ms/step" if kernels is not None else "")
              + (f", largest program {largest / 2**30:.2f} GiB" if largest is not None else ""), file=sys.stderr)
    return rows


def _peer_row(peer: dict | None, attn: str, ctx: int) -> dict | None:
    for r in (peer or {}).get("rows", []):
        if r["attn"] == attn and r["context"] == ctx:
            return r
    return None


def _torch_row(peer: dict | None, r: Row) -> dict | None:
    """The torch peer's row for our row ``r`` (same weights and context; the peer runs one GPU, dense
    attention, batch 1)."""
    if r.sparse != "off" or r.tensor_parallel != 1 or r.spmd or r.batch_size != 1:
        return None
    quant = "int4" if r.quant.startswith("int4") else r.quant  # ours reads "int4 g128"
    for p in (peer or {}).get("rows", []):
        if p["quant"] == quant and p["context"] == r.context:
            return p
    return None


def markdown(rows: list[Row], bandwidth: float, flops: float, device: str, peer: dict | None = None,
             torch_peer: dict | None = None, copy_source: str = "XLA copy", matmul_source: str = "XLA dot") -> str:
    attns = sorted({r["attn"] for r in (peer or {}).get("rows", [])})
    head = ("| shape | attention | weights | sparse | TP | KV | batch | context | max_length | decode ms/token (runs) | "
            "roofline ms | % of roofline | decode vs dense | vs TP 1 | vs contiguous | collectives µs/layer | "
            "prefill tok/s (runs) | % of matmul roofline | KV cache GB/device | peak GPU GB |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for a in attns:
        head += f" HF {a} decode ms/token | ours vs HF {a} decode | HF {a} prefill tok/s |"
        sep += "---|---|---|"
    if torch_peer:
        head += " torch decode ms/token | ours vs torch decode | torch prefill tok/s |"
        sep += "---|---|---|"
    lines = [
        f"device: {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s ({copy_source}); bf16 matmul {flops / 1e12:.0f} "
        f"TFLOP/s ({matmul_source})",
        "",
        head,
        sep,
    ]
    for r in rows:
        runs = ", ".join(f"{x:.3f}" for x in r.decode_ms_per_token)
        pre = ", ".join(f"{x:,.0f}" for x in r.prefill_tok_s)
        pct_pre = 100 * statistics.median(r.prefill_tok_s) / r.prefill_roofline_tok_s
        dense = [d for d in rows if d.quant == "none" and d.sparse == "off" and d.tensor_parallel == r.tensor_parallel
                 and d.spmd == r.spmd and (d.attention_impl, d.context, d.kv_cache) == (r.attention_impl, r.context,
                                                                                       r.kv_cache)]
        vs_dense = f"{dense[0].decode_ms / r.decode_ms:.2f}x" if dense else "n/a"
        single = [d for d in rows if d.tensor_parallel == 1 and not d.spmd and (d.attention_impl, d.quant, d.sparse,
                  d.context, d.batch_size, d.kv_cache) == (r.attention_impl, r.quant, r.sparse, r.context, r.batch_size,
                                                           r.kv_cache)]
        vs_tp1 = f"{single[0].decode_ms / r.decode_ms:.2f}x" if single else "n/a"
        same = [d for d in rows if d.kv_cache == "contiguous" and (d.attention_impl, d.quant, d.sparse, d.context,
                d.batch_size, d.tensor_parallel, d.spmd) == (r.attention_impl, r.quant, r.sparse, r.context,
                                                             r.batch_size, r.tensor_parallel, r.spmd)]
        vs_contiguous = f"{same[0].decode_ms / r.decode_ms:.3f}x" if same and r.kv_cache != "contiguous" else "n/a"
        collectives = "n/a" if r.allreduce_us_per_layer is None else f"{r.allreduce_us_per_layer:.1f}"
        if r.kernel_ms_per_step is not None:
            collectives += f" (kernels {r.kernel_ms_per_step:.2f} ms/step)"
        if r.gpu_timeline_per_step:
            t = r.gpu_timeline_per_step
            collectives += f" (GPU 0 busy {t['busy_s']:.2f} of {t['span_s']:.2f} ms/step, {t['launches']:.0f} kernels)"
        tp = f"{r.tensor_parallel}{' (spmd)' if r.spmd and r.tensor_parallel == 1 else ''}"
        peak = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 1e9:.1f}"
        line = (f"| {r.shape} | {r.attention_impl} | {r.quant} | {r.sparse} | {tp} | {r.kv_cache} | {r.batch_size} | "
                f"{r.context} | {r.max_length} | {r.decode_ms:.3f} ({runs}) | {r.roofline_ms:.3f} | {r.pct_roofline:.1f}% | "
                f"{vs_dense} | {vs_tp1} | {vs_contiguous} | {collectives} | {pre} | {pct_pre:.1f}% | "
                f"{r.cache_bytes / 1e9:.2f} | {peak} |")
        for a in attns:
            p = _peer_row(peer, a, r.context)
            if p is None or not p["decode_ms_per_token"]:
                why = "n/a" if p is None or not p["error"] else ("OOM" if "out of GPU memory" in p["error"] else "error")
                line += f" {why} | n/a | n/a |"
            else:
                hf_ms = statistics.median(p["decode_ms_per_token"])
                line += f" {hf_ms:.2f} | {hf_ms / r.decode_ms:.1f}x faster | {statistics.median(p['prefill_tok_s']):,.0f} |"
        if torch_peer:
            p = _torch_row(torch_peer, r)
            if p is None or not p["decode_ms_per_token"]:
                why = "n/a" if p is None or not p["error"] else ("OOM" if "out of GPU memory" in p["error"] else "error")
                line += f" {why} | n/a | n/a |"
            else:
                t_ms = statistics.median(p["decode_ms_per_token"])
                line += f" {t_ms:.3f} | {t_ms / r.decode_ms:.2f}x | {statistics.median(p['prefill_tok_s']):,.0f} |"
        lines.append(line)
    if peer:
        lines += ["", f"HF peer: transformers {peer['transformers']}, torch {peer['torch']}, LlamaForCausalLM of the same "
                      f"shape, bf16, batch 1, a bare greedy loop of one-token forwards with its default DynamicCache."]
    if torch_peer:
        lines += ["", f"torch peer: torch {torch_peer['torch']}, a gpt-fast-style decoder of the same shape (static KV "
                      f"cache, the one-token step under torch.compile mode {torch_peer['compile']}; int4: tinygemm g128), "
                      "batch 1; ours vs torch = its ms/token over ours (above 1: we are faster)."]
    return "\n".join(lines)


def run_peer(module: str, args: list[str]) -> dict:
    """Runs ``python -m module args`` (a peer: PyTorch on the same GPU) in a subprocess, before this process
    takes the GPU; returns the JSON object it prints last."""
    cmd = [sys.executable, "-m", module, *args]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    print("  running a peer: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        raise MiniCPMError(f"the peer {module} failed (exit {proc.returncode}); its errors are above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_hf_peer(shape: str, contexts: list[int], decode_steps: int, attns: list[str], repeats: int) -> dict:
    """``benchmarks.hf_peer``'s rows (HF transformers)."""
    return run_peer("benchmarks.hf_peer", ["--shape", shape, "--contexts", ",".join(map(str, contexts)),
                                           "--decode_steps", str(decode_steps), "--attn", ",".join(attns),
                                           "--repeats", str(repeats)])


def run_torch_peer(shape: str, contexts: list[int], decode_steps: int, quants: list[str], repeats: int,
                   group_size: int) -> dict:
    """``benchmarks.torch_peer``'s rows (gpt-fast-style PyTorch, bf16 and tinygemm int4)."""
    return run_peer("benchmarks.torch_peer", ["--shape", shape, "--contexts", ",".join(map(str, contexts)),
                                              "--decode_steps", str(decode_steps), "--quants", ",".join(quants),
                                              "--repeats", str(repeats), "--group_size", str(group_size)])
