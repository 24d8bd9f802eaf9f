"""Benchmarks: ``python -m minicpm_jax.bench --scenarios kernels,e2e --shape minicpm4-8b``.

Every number is printed next to the ceiling it is measured against, taken in the same run: a
device-to-device copy (memory-bound rows) or a large bf16 matmul (compute-bound rows).

Scenarios (``--scenarios``, comma-separated):

* ``kernels`` — attention micro-benchmarks at the shape's attention dims (bf16, batch 1): causal prefill
  of a whole prompt (``--prefill_contexts``; TFLOP/s vs the matmul) and one-token decode against a cache
  (``--decode_contexts``; GB/s of the K/V bytes that must be read vs the copy bandwidth), for the Pallas
  kernels, the plain-XLA reference and cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``).
  Kernels are timed as many calls inside one jit (µs-scale), two timed repeats after a warm-up.
* ``e2e`` — the real engine (chunked prefill, on-device decode loop) on the named shape with random
  weights, per ``--attention_impls`` and ``--contexts``: decode ms/token vs (weights + valid K/V bytes) /
  copy bandwidth, prefill tok/s vs FLOPs per token (2 per matmul weight plus causal attention,
  2·layers·heads·head_dim·(context+1) on average) / matmul FLOP/s. All contexts share one
  static cache (``--max_length``), so rows show how cost follows the actual context.
* ``load`` — ``load_model`` of the shape's random weights from HF safetensors vs the native format.
* ``int4`` — the W4A16 dequant-GEMM (``pallas_kernels.int4_matmul``) on every linear shape of the model
  at ``--int4_ms`` rows, per ``--int4_layouts``, against bf16 ``jnp.dot`` and the copy bandwidth (see
  ``bench_int4``). e2e rows for int4 weights come from ``--quants none,int4`` (random int4 weights,
  group ``--quant_group_size``; the decode roofline then counts int4 codes + scales).

* ``spec`` — EAGLE speculative decoding at ``--spec_context``: tree-verify cost vs a plain decode
  step for ``--spec_tree_sizes``, and oracle-draft rounds (``--spec_oracle_accept K``: exactly K tokens a
  round) against plain decode, for each of ``--quants``, with the draft / verify / compact split (see
  ``bench_spec``).
* ``sparse`` — InfLLM-v2 attention of one layer against the dense Pallas kernels: the whole prefill of
  ``--sparse_prefill_contexts`` prompts in ``--chunk_length`` chunks, and one-token decode at
  ``--sparse_decode_contexts`` (see ``bench_sparse``). e2e rows with sparse attention come from
  ``--sparse_modes off,on`` (the shape's sparse_config, else MiniCPM4's), with the KV + compressed cache
  bytes and the peak GPU memory.

``--peer hf`` first runs HF transformers (PyTorch, same GPU, same shape, random weights; see
``bench_hf``) on the e2e contexts, in a subprocess before JAX takes the GPU, and adds its rows and our
ratio to it. Writes JSON (``--json_out``) and markdown (``--markdown_out``); prints the markdown last;
``--plot out.png`` draws decode ms/token against context (needs matplotlib; ``--plot_from`` re-plots a
saved JSON without a GPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from minicpm_jax.bench_sparse import bench_sparse, sparse_markdown
from minicpm_jax.bench_spec import bench_speculative, spec_markdown
from minicpm_jax.cache import KVCache
from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.engine import Engine
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.bench_int4 import bench_int4, int4_markdown, linear_shapes
from minicpm_jax.model import MiniCPMForCausalLM
from minicpm_jax.quant import QuantSpec
from pallas_kernels.attention import attention_reference, decode_attention, decode_attention_splits, prefill_attention
from pallas_kernels.int4_matmul import KERNELS as INT4_KERNELS
from pallas_kernels.timing import device_loop_time

SHAPES = {
    "minicpm4-8b": dict(
        model_type="minicpm", vocab_size=73448, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=2, max_position_embeddings=32768, scale_emb=12,
        scale_depth=1.4, dim_model_base=256, tie_word_embeddings=False,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [1.0] * 64,
                      "original_max_position_embeddings": 32768},
    ),
    "minicpm4-0.5b": dict(
        model_type="minicpm", vocab_size=73448, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, scale_emb=12,
        scale_depth=1.4, dim_model_base=256, tie_word_embeddings=True,
    ),
    # MiniCPM4's structure (scalings, untied head, GQA) at toy size: CPU smoke runs of every scenario.
    "minicpm4-tiny": dict(
        model_type="minicpm", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, scale_emb=12,
        scale_depth=1.4, dim_model_base=256, tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}

FLAGS = flags.FLAGS
SCENARIOS = ("e2e", "kernels", "load", "int4", "sparse", "spec")
flags.DEFINE_list("scenarios", ["e2e"], "Which benchmarks: e2e (prefill + decode), kernels (attention), load, "
                  "int4 (dequant-GEMM), sparse (InfLLM-v2 attention vs dense).")
flags.DEFINE_enum("shape", "minicpm4-8b", list(SHAPES), "Model shape (random weights).")
flags.DEFINE_string("scratch_dir", "/tmp/minicpm_jax_bench", "Where the load scenario writes its checkpoints.")
flags.DEFINE_list("contexts", ["1024"], "e2e: context lengths (prompt tokens before decoding).")
flags.DEFINE_list("attention_impls", ["auto"], "e2e: attention paths to run (auto, pallas, xla), one row each.")
flags.DEFINE_list("quants", ["none"], "e2e: weight formats to run (none = dense --dtype, int4 = W4A16), one row each.")
flags.DEFINE_integer("quant_group_size", 128, "e2e and int4: int4 scale group size.")
flags.DEFINE_list("int4_ms", ["1", "16", "64"], "int4: activation rows (1 = decode GEMV; 16/64 = tree verify, batches).")
flags.DEFINE_list("int4_layouts", ["kpacked", "marlin"], "int4: weight layouts to time.")
flags.DEFINE_list("int4_kernels", ["auto"], "int4: kernels to time (auto = what the model runs; tile, planes, "
                  "planes_t = pallas_kernels.int4_matmul.KERNELS; the plane kernels read kpacked only).")
flags.DEFINE_list("sparse_modes", ["off"], "e2e: InfLLM-v2 modes to run (off = dense attention, on = the checkpoint's "
                  "or MiniCPM4's sparse_config), one row each.")
flags.DEFINE_list("sparse_prefill_contexts", ["32768", "65536", "131072"], "sparse: prompt lengths.")
flags.DEFINE_list("sparse_decode_contexts", ["8192", "32768", "131072"], "sparse: cache lengths for decode.")
flags.DEFINE_integer("spec_context", 1024, "spec: context length of the speculative rows.")
flags.DEFINE_list("spec_tree_sizes", ["16", "32", "64"], "spec: tree sizes of the verify rows (the largest is used for "
                  "the oracle rounds).")
flags.DEFINE_list("spec_oracle_accept", ["3"], "spec: accept lengths forced by the oracle draft (tokens per round).")
flags.DEFINE_integer("spec_oracle_tree_size", 32, "spec: tree nodes of the oracle rounds.")
flags.DEFINE_integer("spec_frspec_vocab", 32768, "spec: FR-Spec draft vocabulary of the oracle rounds (0 = full).")
flags.DEFINE_list("prefill_contexts", ["2048", "8192", "32768"], "kernels: causal prompt lengths.")
flags.DEFINE_list("decode_contexts", ["1024", "8192", "32768", "131072"], "kernels: cache lengths for decode.")
flags.DEFINE_integer("batch_size", 1, "Sequences decoded together.")
flags.DEFINE_integer("decode_steps", 128, "Tokens decoded per timed run.")
flags.DEFINE_integer("decode_block", 32, "Decode steps per host round trip.")
flags.DEFINE_integer("chunk_length", 1024, "Prefill chunk length.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Weight/activation dtype.")
flags.DEFINE_integer("repeats", 2, "Timed repeats per row (all are reported, to show the spread).")
flags.DEFINE_integer("max_length", None, "Static cache length (default: largest context + decode_steps + 8).")
flags.DEFINE_enum("peer", "none", ["none", "hf"], "Also run this peer on the e2e rows (hf: transformers on the GPU).")
flags.DEFINE_list("peer_attn", ["eager", "sdpa"], "HF attn_implementation values to run with --peer hf.")
flags.DEFINE_integer("peer_decode_steps", 32, "Tokens the HF peer decodes per timed run.")
flags.DEFINE_boolean("xla_command_buffers", True, "CUDA graphs for while/conditional bodies, as run and server "
                     "use (minicpm_jax.gpu_setup).")
flags.DEFINE_string("json_out", None, "Write all results as JSON here.")
flags.DEFINE_string("markdown_out", None, "Write the markdown tables here.")
flags.DEFINE_string("plot", None, "Draw decode ms/token vs context (e2e rows, kernels' decode rows) to this PNG.")
flags.DEFINE_string("plot_from", None, "Only re-draw --plot from this saved --json_out file (no benchmarks run).")
flags.DEFINE_string("dump_hlo", None, "Write the optimized HLO of the decode block to this file.")


def _median_time(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return times


def copy_bandwidth(nbytes: int = 2 * 1024**3, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted).

    The better of a plain buffer copy (a device memcpy) and an elementwise pass, median of ``repeats``.
    """
    x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 2,), jnp.float32).astype(jnp.bfloat16)
    best = 0.0
    for fn in (jax.jit(jnp.copy), jax.jit(lambda a: a + jnp.bfloat16(1))):
        best = max(best, 2 * x.nbytes / statistics.median(_median_time(lambda: fn(x), repeats)))
    return best


def matmul_flops(n: int = 8192, repeats: int = 10) -> float:
    """bf16 matmul throughput (FLOP/s) of an n×n×n product, median of ``repeats``."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / statistics.median(_median_time(lambda: mm(a, b), repeats))


def decode_weight_bytes(config: ModelConfig, itemsize: int, quant: QuantSpec | None = None) -> int:
    """Bytes of weights one decode step reads: every parameter except the gathered embedding table
    (a tied head still reads the table once, as lm_head). With int4 the decoder linears count their
    codes (half a byte per weight) and fp16 scales (and zeros)."""
    params = config.num_params - (0 if config.tied_head else config.vocab_size * config.hidden_size)
    if quant is None:
        return params * itemsize
    linear = 0
    qbytes = 0
    for k, n in linear_shapes(config).values():
        groups = k // quant.rows_per_group(k)
        linear += k * n
        qbytes += k * n // 2 + groups * n * 2 * (1 if quant.sym else 2)
    return (params - config.num_layers * linear) * itemsize + config.num_layers * qbytes


def prefill_flops_per_token(config: ModelConfig, context: int) -> float:
    """FLOPs per prompt token of a ``context``-token prefill: the matmuls (2 per weight, the gathered
    embedding table excluded) plus causal attention (QK^T and PV over the visible keys:
    4·layers·heads·head_dim·(context+1)/2 on average)."""
    return 2 * decode_weight_bytes(config, 1) + 2 * config.num_layers * config.num_heads * config.head_dim * (context + 1)


def random_model(config: ModelConfig, max_length: int, dtype, attention_impl: str = "auto",
                 quant: QuantSpec | None = None, sparse: str = "off") -> MiniCPMForCausalLM:
    """Random-weight model created directly on the default device (the same weights for every impl)."""
    from flax import nnx

    return MiniCPMForCausalLM(config, max_length=max_length, dtype=dtype, attention_impl=attention_impl,
                              rngs=nnx.Rngs(0), quant=quant, sparse=sparse)


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

    @property
    def decode_ms(self) -> float:
        return statistics.median(self.decode_ms_per_token)

    @property
    def pct_roofline(self) -> float:
        return 100 * self.roofline_ms / self.decode_ms


def bench_end_to_end(shape: str, contexts: list[int], batch_size: int, decode_steps: int, decode_block: int,
                     chunk_length: int, dtype, repeats: int, bandwidth: float, flops: float,
                     max_length: int | None = None, dump_hlo: str | None = None,
                     attention_impl: str = "auto", quant: QuantSpec | None = None, sparse: str = "off") -> list[Row]:
    config = ModelConfig.from_dict(SHAPES[shape])
    max_length = max_length or max(contexts) + decode_steps + 8
    if max_length < max(contexts) + decode_steps:
        raise MiniCPMError(f"--max_length {max_length} is too small for context {max(contexts)} + {decode_steps} steps")
    model = random_model(config, max_length, dtype, attention_impl, quant, sparse)
    impl = model.attention_impl
    cache_bytes = KVCache.nbytes(config, batch_size, max_length, dtype, model.sparse)
    qname = "none" if quant is None else f"int4 g{quant.group_size}"
    engine = Engine(model, batch_size=batch_size, chunk_length=min(chunk_length, max_length), decode_block=decode_block)
    itemsize = jnp.dtype(dtype).itemsize
    wbytes = decode_weight_bytes(config, itemsize, quant)
    rng = np.random.default_rng(0)
    rows = []
    for ctx in contexts:
        prompts = [list(rng.integers(0, config.vocab_size, ctx)) for _ in range(batch_size)]
        engine.generate(prompts, max_new_tokens=decode_steps)  # compile + warm up
        if dump_hlo:
            with open(dump_hlo, "w") as f:
                f.write(engine.compiled_decode_hlo())
            dump_hlo = None
        pre, dec = [], []
        for _ in range(repeats):
            results, stats = engine.generate(prompts, max_new_tokens=decode_steps)
            assert all(len(r.token_ids) == decode_steps for r in results)
            pre.append(stats.prefill_tokens_per_s)
            dec.append(1e3 * stats.decode_time / (decode_steps - 1))  # per step (all rows advance together)
        # The least KV a step must read is the valid context (the xla path reads all max_length slots).
        kv_bytes = 2 * config.num_layers * batch_size * config.num_kv_heads * ctx * config.head_dim * itemsize
        roofline_ms = 1e3 * (wbytes + kv_bytes) / bandwidth
        prefill_roof = flops / prefill_flops_per_token(config, ctx)
        stats = jax.devices()[0].memory_stats() or {}
        rows.append(Row(shape, impl, qname, ctx, batch_size, max_length, pre, dec, roofline_ms, prefill_roof, sparse,
                        cache_bytes, stats.get("peak_bytes_in_use")))
        print(f"  {shape} {impl} {qname} sparse={sparse} ctx={ctx}: decode {dec} ms/token (roofline {roofline_ms:.3f} ms), prefill {pre} tok/s",
              file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------------ attention kernels
L2_BYTES = 50 * 1024**2  # H100 L2; decode rows cycle through enough layers of cache to stream past it


def _attention_inputs(config: ModelConfig, t: int, s: int, layers: int, dtype, seed: int):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (1, t, config.num_heads, config.head_dim), jnp.float32).astype(dtype)
    shape = (layers, 1, config.num_kv_heads, s, config.head_dim)
    k = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], shape, jnp.float32).astype(dtype)
    return q, k, v


def _cudnn_attention(q, k_bshd, v_bshd, lengths, *, causal: bool):
    return jax.nn.dot_product_attention(q, k_bshd, v_bshd, is_causal=causal, key_value_seq_lengths=lengths,
                                        implementation="cudnn")


def _time_impls(impls: dict, args_for: dict, iters: int, repeats: int) -> dict:
    """{name: seconds per call (runs)} or {name: "error ..."} for each implementation."""
    out = {}
    for name, fn in impls.items():
        try:
            out[name] = device_loop_time(fn, args_for[name], iters=iters, repeats=repeats)
        except Exception as e:  # e.g. cuDNN without a kernel for this shape, or the S^2 reference out of memory
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"    {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def bench_prefill_kernel(config: ModelConfig, ctx: int, dtype, repeats: int) -> dict:
    """Causal attention over a whole ``ctx``-token prompt (one chunk at offset 0)."""
    q, k, v = _attention_inputs(config, ctx, ctx, 1, dtype, seed=ctx)
    positions = jnp.arange(ctx, dtype=jnp.int32)[None]
    lengths = jnp.array([ctx], jnp.int32)
    scale = config.head_dim**-0.5
    bshd = lambda x: x[0].transpose(0, 2, 1, 3)  # cuDNN's [B, S, KVH, D] layout
    impls = {
        "pallas": lambda q_, k_, v_, p_, l_: prefill_attention(q_, k_, v_, p_, l_, scale=scale, layer=0),
        "xla": lambda q_, k_, v_, p_, l_: attention_reference(q_, k_, v_, p_, l_, scale=scale, layer=0),
        "cudnn": lambda q_, k_, v_, l_: _cudnn_attention(q_, k_, v_, l_, causal=True),
    }
    args = {"pallas": (q, k, v, positions, lengths), "xla": (q, k, v, positions, lengths),
            "cudnn": (q, bshd(k), bshd(v), lengths)}
    flop = 4 * config.num_heads * config.head_dim * ctx * (ctx + 1) / 2  # QK^T and PV over visible pairs
    iters = max(2, min(50, int(2e13 // flop)))
    print(f"  prefill attention ctx={ctx} ({iters} calls per timing)", file=sys.stderr, flush=True)
    return {"context": ctx, "flop": flop, "seconds": _time_impls(impls, args, iters, repeats)}


def bench_decode_kernel(config: ModelConfig, ctx: int, dtype, repeats: int) -> dict:
    """One query token per sequence against ``ctx`` cached keys; successive calls read different layers'
    caches so the K/V bytes come from HBM, not L2."""
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * config.num_kv_heads * ctx * config.head_dim * itemsize  # per layer, K and V
    layers = max(1, min(32, -(-4 * L2_BYTES // kv_bytes)))
    q, k, v = _attention_inputs(config, 1, ctx, layers, dtype, seed=ctx)
    positions = jnp.array([[ctx - 1]], jnp.int32)
    lengths = jnp.array([ctx], jnp.int32)
    scale = config.head_dim**-0.5

    def every_layer(kernel):
        def run(q_, k_, v_, p_, l_):
            return [kernel(q_, k_, v_, p_, l_, scale=scale, layer=i) for i in range(layers)]
        return run

    def cudnn_every_layer(q_, k_, v_, l_):
        return [_cudnn_attention(q_, k_[i], v_[i], l_, causal=False) for i in range(layers)]

    bshd = lambda x: x[:, 0].transpose(0, 2, 1, 3)[:, None]  # [layers, 1, S, KVH, D]
    impls = {"pallas": every_layer(decode_attention), "pallas_splits": every_layer(decode_attention_splits),
             "xla": every_layer(attention_reference), "cudnn": cudnn_every_layer}
    args = {"pallas": (q, k, v, positions, lengths), "pallas_splits": (q, k, v, positions, lengths),
            "xla": (q, k, v, positions, lengths), "cudnn": (q, bshd(k), bshd(v), lengths)}
    iters = max(5, min(200, int(2e10 // (kv_bytes * layers))))
    print(f"  decode attention ctx={ctx} ({layers} layers x {iters} calls per timing)", file=sys.stderr, flush=True)
    seconds = _time_impls(impls, args, iters, repeats)
    per_call = {n: [t / layers for t in ts] if isinstance(ts, list) else ts for n, ts in seconds.items()}
    return {"context": ctx, "bytes": kv_bytes, "layers": layers, "seconds": per_call}


def bench_kernels(shape: str, prefill_contexts: list[int], decode_contexts: list[int], dtype, repeats: int) -> dict:
    config = ModelConfig.from_dict(SHAPES[shape])
    return {
        "heads": [config.num_heads, config.num_kv_heads, config.head_dim],
        "dtype": jnp.dtype(dtype).name,
        "prefill": [bench_prefill_kernel(config, c, dtype, repeats) for c in prefill_contexts],
        "decode": [bench_decode_kernel(config, c, dtype, repeats) for c in decode_contexts],
    }


def _cell(times, to_rate) -> str:
    if not isinstance(times, list):
        return "n/a"
    return f"{to_rate(statistics.median(times)):,.0f} ({', '.join(f'{to_rate(t):,.0f}' for t in times)})"


def kernels_markdown(r: dict, bandwidth: float, flops: float) -> str:
    h, kvh, d = r["heads"]
    lines = [
        f"Attention kernels, {h} q heads / {kvh} kv heads / head_dim {d}, {r['dtype']}, batch 1. Ceilings measured in this "
        f"run: bf16 matmul {flops / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s.",
        "",
        "| causal prefill | Pallas TFLOP/s (runs) | % of matmul | XLA TFLOP/s | cuDNN TFLOP/s | Pallas / cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["prefill"]:
        sec, tf = row["seconds"], lambda t, f=row["flop"]: f / t / 1e12
        pct = f"{100 * tf(statistics.median(sec['pallas'])) * 1e12 / flops:.0f}%" if isinstance(sec["pallas"], list) else "n/a"
        ratio = (f"{statistics.median(sec['cudnn']) / statistics.median(sec['pallas']):.2f}x"
                 if isinstance(sec["pallas"], list) and isinstance(sec["cudnn"], list) else "n/a")
        lines.append(f"| {row['context']} | {_cell(sec['pallas'], tf)} | {pct} | {_cell(sec['xla'], tf)} | "
                     f"{_cell(sec['cudnn'], tf)} | {ratio} |")
    lines += [
        "",
        "| decode, 1 token | K/V MB read | Pallas µs (runs) | Pallas GB/s | % of copy | kernel w/o merge µs | XLA µs | cuDNN µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    us = lambda t: 1e6 * t
    for row in r["decode"]:
        sec = row["seconds"]
        if isinstance(sec["pallas"], list):
            gbs = row["bytes"] / statistics.median(sec["pallas"])
            rate, pct = f"{gbs / 1e9:,.0f}", f"{100 * gbs / bandwidth:.0f}%"
        else:
            rate = pct = "n/a"
        fmt = lambda ts: (f"{us(statistics.median(ts)):.1f} ({', '.join(f'{us(t):.1f}' for t in ts)})"
                          if isinstance(ts, list) else "n/a")
        lines.append(f"| {row['context']} | {row['bytes'] / 1e6:.1f} | {fmt(sec['pallas'])} | {rate} | {pct} | "
                     f"{fmt(sec['pallas_splits'])} | {fmt(sec['xla'])} | {fmt(sec['cudnn'])} |")
    return "\n".join(lines)


def write_random_hf_checkpoint(shape: str, path: str, dtype=jnp.bfloat16, shard_bytes: int = 4 * 1024**3) -> int:
    """Writes a random HF-named safetensors checkpoint of ``shape`` (content: one random block tiled,
    which is enough to time reading); returns its size in bytes."""
    import ml_dtypes

    from checkpoints_convert.common import ShardedSafetensorsWriter, atomic_output_dir, write_json
    from minicpm_jax.weights import param_sources

    config = ModelConfig.from_dict(SHAPES[shape])
    np_dtype = {jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16, jnp.dtype(jnp.float16): np.float16}.get(jnp.dtype(dtype), np.float32)
    block = (np.random.default_rng(0).standard_normal(1 << 24) * 0.02).astype(np_dtype)
    with atomic_output_dir(path, overwrite=True) as tmp:
        writer = ShardedSafetensorsWriter(tmp, shard_bytes)
        for src in param_sources(config, set()):
            for name, shp in zip(src.names, src.shapes):
                writer.add(name, np.resize(block, shp))
        writer.close()
        write_json(f"{tmp}/config.json", config.to_hf_dict())
    return writer.total_bytes


def bench_load(shape: str, scratch: str, dtype, repeats: int) -> dict:
    """Seconds to ``load_model`` the same random weights from HF safetensors and from the native format."""
    import os

    from flax import nnx

    from checkpoints_convert.hf import convert_hf
    from minicpm_jax.weights import load_model

    hf_dir, native_dir = os.path.join(scratch, f"{shape}-hf"), os.path.join(scratch, f"{shape}-native")
    nbytes = write_random_hf_checkpoint(shape, hf_dir, dtype)
    t = time.perf_counter()
    convert_hf(hf_dir, native_dir, overwrite=True)
    convert_s = time.perf_counter() - t
    times: dict[str, list[float]] = {"hf": [], "native": []}
    for _ in range(repeats):
        for kind, path in (("hf", hf_dir), ("native", native_dir)):
            t = time.perf_counter()
            model = load_model(path, dtype=dtype, max_length=64)
            jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
            times[kind].append(time.perf_counter() - t)
            del model
    print(f"  load {shape}: {times} ({nbytes / 1e9:.2f} GB); convert {convert_s:.1f} s", file=sys.stderr)
    return {"shape": shape, "bytes": nbytes, "convert_s": convert_s, "hf_s": times["hf"], "native_s": times["native"]}


def load_markdown(r: dict) -> str:
    hf, nat = statistics.median(r["hf_s"]), statistics.median(r["native_s"])
    return "\n".join([
        "| shape | checkpoint GB | HF safetensors load s (runs) | native load s (runs) | speed-up |",
        "|---|---|---|---|---|",
        f"| {r['shape']} | {r['bytes'] / 1e9:.2f} | {hf:.2f} ({', '.join(f'{x:.2f}' for x in r['hf_s'])}) | "
        f"{nat:.2f} ({', '.join(f'{x:.2f}' for x in r['native_s'])}) | {hf / nat:.2f}x |",
    ])


def _peer_row(peer: dict | None, attn: str, ctx: int) -> dict | None:
    for r in (peer or {}).get("rows", []):
        if r["attn"] == attn and r["context"] == ctx:
            return r
    return None


def markdown(rows: list[Row], bandwidth: float, flops: float, device: str, peer: dict | None = None) -> str:
    attns = sorted({r["attn"] for r in (peer or {}).get("rows", [])})
    head = ("| shape | attention | weights | sparse | batch | context | max_length | decode ms/token (runs) | roofline ms | "
            "% of roofline | decode vs dense | prefill tok/s (runs) | % of matmul roofline | KV cache GB | peak GPU GB |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for a in attns:
        head += f" HF {a} decode ms/token | ours vs HF {a} decode | HF {a} prefill tok/s |"
        sep += "---|---|---|"
    lines = [
        f"device: {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; bf16 matmul {flops / 1e12:.0f} TFLOP/s",
        "",
        head,
        sep,
    ]
    for r in rows:
        runs = ", ".join(f"{x:.3f}" for x in r.decode_ms_per_token)
        pre = ", ".join(f"{x:,.0f}" for x in r.prefill_tok_s)
        pct_pre = 100 * statistics.median(r.prefill_tok_s) / r.prefill_roofline_tok_s
        dense = [d for d in rows if d.quant == "none" and d.sparse == "off"
                 and (d.attention_impl, d.context) == (r.attention_impl, r.context)]
        vs_dense = f"{dense[0].decode_ms / r.decode_ms:.2f}x" if dense else "n/a"
        peak = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 1e9:.1f}"
        line = (f"| {r.shape} | {r.attention_impl} | {r.quant} | {r.sparse} | {r.batch_size} | {r.context} | "
                f"{r.max_length} | {r.decode_ms:.3f} ({runs}) | {r.roofline_ms:.3f} | {r.pct_roofline:.1f}% | {vs_dense} | "
                f"{pre} | {pct_pre:.1f}% | {r.cache_bytes / 1e9:.2f} | {peak} |")
        for a in attns:
            p = _peer_row(peer, a, r.context)
            if p is None or not p["decode_ms_per_token"]:
                why = "n/a" if p is None or not p["error"] else ("OOM" if "out of GPU memory" in p["error"] else "error")
                line += f" {why} | n/a | n/a |"
            else:
                hf_ms = statistics.median(p["decode_ms_per_token"])
                line += f" {hf_ms:.2f} | {hf_ms / r.decode_ms:.1f}x faster | {statistics.median(p['prefill_tok_s']):,.0f} |"
        lines.append(line)
    if peer:
        lines += ["", f"HF peer: transformers {peer['transformers']}, torch {peer['torch']}, LlamaForCausalLM of the same "
                      f"shape, bf16, batch 1, a bare greedy loop of one-token forwards with its default DynamicCache."]
    return "\n".join(lines)


def run_hf_peer(shape: str, contexts: list[int], decode_steps: int, attns: list[str], repeats: int) -> dict:
    """Runs ``minicpm_jax.bench_hf`` in a subprocess (before this process takes the GPU)."""
    cmd = [sys.executable, "-m", "minicpm_jax.bench_hf", "--shape", shape, "--contexts", ",".join(map(str, contexts)),
           "--decode_steps", str(decode_steps), "--attn", ",".join(attns), "--repeats", str(repeats)]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    print("  running the HF peer: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        raise MiniCPMError(f"the HF peer failed (exit {proc.returncode}); its errors are above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(result: dict, path: str) -> None:
    """decode ms/token vs context (e2e rows by attention path, HF peer rows) and decode-kernel µs vs context."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MiniCPMError("--plot needs matplotlib (pip install matplotlib)") from None
    panels = [k for k in ("rows", "kernels") if result.get(k)]
    if not panels:
        raise MiniCPMError("nothing to plot: the results have no e2e or kernels rows")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "rows":
            series = sorted({(r["attention_impl"], r.get("quant", "none")) for r in result["rows"]})
            for impl, quant in series:
                rows = sorted((r for r in result["rows"] if (r["attention_impl"], r.get("quant", "none")) == (impl, quant)),
                              key=lambda r: r["context"])
                label = impl if quant == "none" else f"{impl}, {quant}"
                ax.plot([r["context"] for r in rows], [statistics.median(r["decode_ms_per_token"]) for r in rows], "o-",
                        label=f"minicpm-jax ({label})")
            for attn in sorted({r["attn"] for r in result.get("peer", {}).get("rows", [])}):
                rows = [r for r in result["peer"]["rows"] if r["attn"] == attn and r["decode_ms_per_token"]]
                ax.plot([r["context"] for r in rows], [statistics.median(r["decode_ms_per_token"]) for r in rows], "s--",
                        label=f"HF transformers ({attn})")
            ax.set_title(f"{result['shape']} decode, batch 1")
            ax.set_ylabel("ms / token")
            ax.set_yscale("log")
        else:
            for impl in ("pallas", "xla", "cudnn"):
                pts = [(r["context"], 1e6 * statistics.median(r["seconds"][impl])) for r in result["kernels"]["decode"]
                       if isinstance(r["seconds"].get(impl), list)]
                if pts:
                    ax.plot(*zip(*pts), "o-", label=impl)
            ax.set_title("decode attention kernel (one layer)")
            ax.set_ylabel("µs / call")
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(result.get("device", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    if FLAGS.xla_command_buffers:
        from minicpm_jax.gpu_setup import enable_command_buffers

        enable_command_buffers()
    try:
        _main()
    except MiniCPMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _int_list(name: str, values: list[str]) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise MiniCPMError(f"--{name} must be integers, got {','.join(values)}") from None
    if any(v < 1 for v in out):
        raise MiniCPMError(f"--{name} must be positive, got {','.join(values)}")
    return out


def _main():
    if FLAGS.plot_from:
        if not FLAGS.plot:
            raise MiniCPMError("--plot_from needs --plot OUT.png")
        try:
            with open(FLAGS.plot_from) as f:
                plot(json.load(f), FLAGS.plot)
        except (OSError, json.JSONDecodeError) as e:
            raise MiniCPMError(f"cannot read {FLAGS.plot_from}: {e}") from None
        print(f"wrote {FLAGS.plot}")
        return
    contexts = _int_list("contexts", FLAGS.contexts)
    unknown = set(FLAGS.scenarios) - set(SCENARIOS)
    if unknown:
        raise MiniCPMError(f"--scenarios: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SCENARIOS)})")
    bad_quant = set(FLAGS.quants) - {"none", "int4"}
    if bad_quant:
        raise MiniCPMError(f"--quants: unknown {', '.join(sorted(bad_quant))} (choose from none, int4)")
    quant_spec = QuantSpec(group_size=FLAGS.quant_group_size)
    bad_layout = set(FLAGS.int4_layouts) - {"kpacked", "marlin"}
    if bad_layout:
        raise MiniCPMError(f"--int4_layouts: unknown {', '.join(sorted(bad_layout))} (choose from kpacked, marlin)")
    bad_kernel = set(FLAGS.int4_kernels) - {"auto", *INT4_KERNELS}
    if bad_kernel:
        raise MiniCPMError(f"--int4_kernels: unknown {', '.join(sorted(bad_kernel))} (choose from auto, "
                           f"{', '.join(INT4_KERNELS)})")
    bad_sparse = set(FLAGS.sparse_modes) - {"off", "on", "auto"}
    if bad_sparse:
        raise MiniCPMError(f"--sparse_modes: unknown {', '.join(sorted(bad_sparse))} (choose from off, on, auto)")
    bad_impl = set(FLAGS.attention_impls) - {"auto", "xla", "pallas"}
    if bad_impl:
        raise MiniCPMError(f"--attention_impls: unknown {', '.join(sorted(bad_impl))} (choose from auto, xla, pallas)")
    if FLAGS.max_length and "e2e" in FLAGS.scenarios and FLAGS.max_length < max(contexts) + FLAGS.decode_steps:
        raise MiniCPMError(f"--max_length {FLAGS.max_length} is too small for context {max(contexts)} + "
                           f"{FLAGS.decode_steps} steps")
    result: dict = {"shape": FLAGS.shape, "argv": sys.argv[1:]}
    if FLAGS.peer == "hf":  # before JAX allocates GPU memory
        result["peer"] = run_hf_peer(FLAGS.shape, contexts, FLAGS.peer_decode_steps, FLAGS.peer_attn, FLAGS.repeats)
    device = jax.devices()[0].device_kind
    result.update(device=device, jax=jax.__version__)
    tables = []
    dtype = jnp.dtype(FLAGS.dtype)
    if {"e2e", "kernels", "int4"} & set(FLAGS.scenarios):
        small = jax.default_backend() == "cpu"  # CPU numbers are for smoke runs only
        bandwidth = copy_bandwidth(256 * 1024**2 if small else 2 * 1024**3)
        flops = matmul_flops(1024 if small else 8192)
        result.update(copy_bandwidth_Bps=bandwidth, matmul_flops=flops)
    if "load" in FLAGS.scenarios:
        result["load"] = bench_load(FLAGS.shape, FLAGS.scratch_dir, dtype, FLAGS.repeats)
        tables.append(load_markdown(result["load"]))
    if "kernels" in FLAGS.scenarios:
        result["kernels"] = bench_kernels(FLAGS.shape, _int_list("prefill_contexts", FLAGS.prefill_contexts),
                                          _int_list("decode_contexts", FLAGS.decode_contexts), dtype, FLAGS.repeats)
        tables.append(kernels_markdown(result["kernels"], bandwidth, flops))
    if "int4" in FLAGS.scenarios:
        config = ModelConfig.from_dict(SHAPES[FLAGS.shape])
        result["int4"] = bench_int4(config, _int_list("int4_ms", FLAGS.int4_ms), FLAGS.int4_layouts,
                                    quant_spec.group_size, FLAGS.repeats, kernels=tuple(FLAGS.int4_kernels))
        tables.append(int4_markdown(result["int4"], bandwidth))
    if "sparse" in FLAGS.scenarios:
        config = ModelConfig.from_dict(SHAPES[FLAGS.shape])
        result["sparse"] = bench_sparse(config, config.sparse or SparseConfig(),
                                        _int_list("sparse_prefill_contexts", FLAGS.sparse_prefill_contexts),
                                        _int_list("sparse_decode_contexts", FLAGS.sparse_decode_contexts),
                                        FLAGS.chunk_length, dtype, FLAGS.repeats)
        tables.append(sparse_markdown(result["sparse"]))
    if "spec" in FLAGS.scenarios:
        result["spec"] = bench_speculative(ModelConfig.from_dict(SHAPES[FLAGS.shape]), FLAGS.spec_context,
                                           _int_list("spec_tree_sizes", FLAGS.spec_tree_sizes),
                                           _int_list("spec_oracle_accept", FLAGS.spec_oracle_accept), FLAGS.quants,
                                           quant_spec.group_size, dtype, FLAGS.decode_steps, FLAGS.repeats,
                                           random_model, FLAGS.spec_oracle_tree_size, FLAGS.spec_frspec_vocab)
        tables.append(spec_markdown(result["spec"]))
    if "e2e" in FLAGS.scenarios:
        rows = []
        dump_hlo = FLAGS.dump_hlo
        for quant in FLAGS.quants:
            for impl in FLAGS.attention_impls:
                for sparse in FLAGS.sparse_modes:
                    rows += bench_end_to_end(FLAGS.shape, contexts, FLAGS.batch_size, FLAGS.decode_steps,
                                             FLAGS.decode_block, FLAGS.chunk_length, dtype, FLAGS.repeats, bandwidth,
                                             flops, FLAGS.max_length, dump_hlo, attention_impl=impl,
                                             quant=quant_spec if quant == "int4" else None, sparse=sparse)
                    dump_hlo = None
        result["rows"] = [dict(dataclasses.asdict(r), pct_roofline=r.pct_roofline) for r in rows]
        tables.append(markdown(rows, bandwidth, flops, device, result.get("peer")))
    text = "\n\n".join(tables)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if FLAGS.markdown_out:
        with open(FLAGS.markdown_out, "w") as f:
            f.write(text + "\n")
    if FLAGS.plot:
        plot(result, FLAGS.plot)
    print(text)


if __name__ == "__main__":
    app.run(main)
