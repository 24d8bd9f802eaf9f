"""The ``sparse`` scenario of ``python -m benchmarks``: InfLLM-v2 attention against dense Pallas
attention, one layer at the shape's attention dims (bf16, batch 1), random q/k/v.

* prefill — the attention of a whole ``L``-token prompt, run as the engine runs it: chunks of
  ``chunk`` queries, each extending the compressed caches and switching to sparse once the sequence
  reaches ``dense_len``; against the dense flash kernel over the same chunks. Also timed: the sparse
  path with stage 2 in one block-sparse pass (no window split), and without stage 2 (compression +
  stage-1 scores, then + the block selection: pooled in the selection kernel, or pooled in XLA first), to
  split the cost. The variants are composed here from the kernels of ``pallas_kernels.infllm``.
* decode — one query token against an ``L``-token cache: the decode path (the two stage-1 passes, then
  selection + block-sparse attention in one kernel, then the split merge) against the flash-decoding
  kernel, by the loop's wall time and by the kernels' own time (a profile of the loop); also timed: the
  general path that prefill chunks take (selection kernels, then the block-sparse kernel) and its parts:
  stage 1, + the block selection (pooled in the selection kernel, or in XLA), the block-sparse kernel.
  Calls cycle through several layers' caches so the bytes come from HBM, not L2. (The compressed-cache
  extension of a decode step is an in-place write of one entry; it is timed in the e2e rows with
  ``--sparse_modes``.)
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.timing import device_loop, device_loop_time, loop_kernel_time, loop_time
from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.infllm.attention import sparse_attention
from minicpm_jax.infllm.compressed import extend_compressed
from minicpm_jax.infllm.policy import geometry
from minicpm_jax.model.cache import KVCache, compressed_sizes
from pallas_kernels import triton, xla
from pallas_kernels.attention import decode_attention, prefill_attention
from pallas_kernels.infllm.select import force_blocks, pool_block_scores, select_top_blocks
from pallas_kernels.infllm.stage1 import compressed_scores
from pallas_kernels.infllm.stage2 import block_sparse_attention

L2_BYTES = 50 * 1024**2


def _cache(config: ModelConfig, sparse: SparseConfig, layers: int, length: int, dtype, seed: int) -> KVCache:
    """Random K/V of ``length`` tokens in ``layers`` layers, with K1/K2 computed from them."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    shape = (layers, 1, config.num_kv_heads, length, config.head_dim)
    k = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
    v = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
    n1, n2 = compressed_sizes(sparse, length)
    cache = KVCache(k=k, v=v, lengths=jnp.zeros((1,), jnp.int32),
                    k1=jnp.zeros((*shape[:3], n1, shape[4]), dtype), k2=jnp.zeros((*shape[:3], n2, shape[4]), dtype))
    full = jnp.array([length], jnp.int32)
    for layer in range(layers):
        cache = jax.jit(lambda c, layer=layer: extend_compressed(c, layer, jnp.zeros((1,), jnp.int32), full, sparse,
                                                                 max_tokens=length, kernels=xla))(cache)
    return KVCache(k=cache.k, v=cache.v, lengths=full, k1=cache.k1, k2=cache.k2)


def select_blocks(q, cache: KVCache, layer: int, pos, lengths, sparse: SparseConfig, *, scale: float,
                  pool_in_kernel: bool = True):
    """Stage 1 and the block selection of the Pallas backend; ``pool_in_kernel=False`` pools the stage-1
    scores in XLA first (the variant the selection kernel replaced)."""
    geo = geometry(sparse)
    num_blocks = -(-cache.max_length // sparse.block_size)
    if pool_in_kernel:
        return triton.select_blocks(q, cache.k1, cache.k2, pos, lengths, scale=scale, geometry=geo,
                                    num_blocks=num_blocks, layer=layer)
    scores = compressed_scores(q, cache.k1, cache.k2, pos, scale=scale, layer=layer, **geo.stage1())
    block_score = pool_block_scores(scores, pos, lengths, kernel1=geo.kernel1, stride1=geo.stride1, ratio=geo.ratio,
                                    num_blocks=num_blocks)
    limit = jnp.broadcast_to((pos // sparse.block_size)[:, None, :], block_score.shape[:-1])
    block_score = force_blocks(block_score, limit, (sparse.init_blocks, sparse.local_blocks))
    return select_top_blocks(block_score, limit, k=min(sparse.num_selected, num_blocks))


def general_sparse_attention(q, cache: KVCache, layer: int, pos, lengths, sparse: SparseConfig, *, scale: float):
    """The selection kernels, then one block-sparse pass over the picks (no decode path, no window split)."""
    blocks = select_blocks(q, cache, layer, pos, lengths, sparse, scale=scale)
    return block_sparse_attention(q, cache.k, cache.v, pos, lengths, blocks, scale=scale, block_size=sparse.block_size,
                                  layer=layer)


def _timed(fn, args, repeats: int) -> list[float]:
    run = jax.jit(fn)
    jax.block_until_ready(run(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        out.append(time.perf_counter() - t)
    return out


def bench_sparse_prefill(config: ModelConfig, sparse: SparseConfig, length: int, chunk: int, dtype,
                         repeats: int) -> dict:
    """Seconds for one layer's attention over an ``length``-token prompt in ``chunk``-query chunks."""
    h, d = config.num_heads, config.head_dim
    scale = d**-0.5
    cache = _cache(config, sparse, 1, length, dtype, seed=length)
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.zeros((1,), jnp.int32), k1=jnp.zeros_like(cache.k1),
                    k2=jnp.zeros_like(cache.k2))
    q_all = jax.random.normal(jax.random.PRNGKey(1), (1, length, h, d), jnp.float32).astype(dtype)
    n_chunks = length // chunk

    def run(mode):
        def body(c, carry):
            cache, acc = carry
            start = c * chunk
            q = lax.dynamic_slice_in_dim(q_all, start, chunk, axis=1)
            pos = (start + jnp.arange(chunk, dtype=jnp.int32))[None]
            kv_len = jnp.full((1,), start + chunk, jnp.int32)
            dense = lambda: prefill_attention(q, cache.k, cache.v, pos, kv_len, scale=scale, layer=0)  # noqa: E731
            if mode == "dense":
                out = dense()
            else:
                cache = extend_compressed(cache, 0, kv_len - chunk, kv_len, sparse, max_tokens=chunk, kernels=triton)
                if mode in ("scores", "select", "select_xla_pool"):  # the stages before the block-sparse attention
                    def sparse_fn():
                        if mode == "scores":
                            s = compressed_scores(q, cache.k1, cache.k2, pos, scale=scale, kernel1=sparse.kernel_size,
                                                  stride1=sparse.kernel_stride, kernel2=sparse.kernel_size2,
                                                  stride2=sparse.kernel_stride2, layer=0)
                            return jnp.broadcast_to(jnp.sum(s[..., :64]).astype(q.dtype), q.shape)
                        blocks = select_blocks(q, cache, 0, pos, kv_len, sparse, scale=scale,
                                               pool_in_kernel=mode == "select")
                        return jnp.broadcast_to(jnp.sum(blocks).astype(q.dtype), q.shape)
                elif mode == "sparse":
                    sparse_fn = lambda: sparse_attention(q, q, cache, 0, pos, kv_len, sparse, scale=scale,  # noqa: E731
                                                         kernels=triton)
                else:
                    sparse_fn = lambda: general_sparse_attention(q, cache, 0, pos, kv_len, sparse,  # noqa: E731
                                                                 scale=scale)
                out = lax.cond(kv_len[0] >= sparse.dense_len, sparse_fn, dense)  # as the model's switch
            return cache, acc + jnp.sum(out[0, -1].astype(jnp.float32))

        return lambda cache_: lax.fori_loop(0, n_chunks, body, (cache_, jnp.zeros((), jnp.float32)))[1]

    print(f"  sparse prefill attention L={length} chunk={chunk}", file=sys.stderr, flush=True)
    seconds = {mode: _timed(run(mode), (cache,), repeats)
               for mode in ("dense", "sparse", "sparse_unsplit", "scores", "select", "select_xla_pool")}
    print(f"    {seconds}", file=sys.stderr, flush=True)
    return {"context": length, "chunk": chunk, "seconds": seconds}


def bench_sparse_decode(config: ModelConfig, sparse: SparseConfig, length: int, dtype, repeats: int,
                        layers: int = 0) -> dict:
    """Seconds per layer for one decode token against ``length`` cached tokens: dense flash-decoding,
    the sparse decode path, and the general path with its stage 1, stage 1 + selection (pooled in the
    selection kernel, and in XLA), and its block-sparse kernel. ``layers``: layers per timed loop
    iteration (0: 8 to 16, see below; the CPU smoke test takes 2, the compile time of each loop grows
    with them)."""
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * config.num_kv_heads * length * config.head_dim * itemsize
    # At least 8 layers per loop iteration: the jitted loop's own cost per iteration (~10 us on an H100) is
    # spread over them (with 2 layers it added ~5 us to each layer's sparse decode time, a fifth of it);
    # more layers where a layer's K/V is small, so the timed reads never come from L2.
    layers = layers or max(8, min(16, -(-4 * L2_BYTES // kv_bytes)))
    cache = _cache(config, sparse, layers, length, dtype, seed=length)
    q = jax.random.normal(jax.random.PRNGKey(2), (1, 1, config.num_heads, config.head_dim), jnp.float32).astype(dtype)
    pos = jnp.array([[length - 1]], jnp.int32)
    scale = config.head_dim**-0.5

    def dense(q_, c, p_):
        return [decode_attention(q_, c.k, c.v, p_, c.lengths, scale=scale, layer=i) for i in range(layers)]

    def full(q_, c, p_, fused=True):
        if not fused:
            return [general_sparse_attention(q_, c, i, p_, c.lengths, sparse, scale=scale) for i in range(layers)]
        return [sparse_attention(q_, q_, c, i, p_, c.lengths, sparse, scale=scale, kernels=triton) for i in range(layers)]

    def select(q_, c, p_, scores_only=False, pool_in_kernel=True):
        if not scores_only:
            return [select_blocks(q_, c, i, p_, c.lengths, sparse, scale=scale, pool_in_kernel=pool_in_kernel)
                    for i in range(layers)]
        return [compressed_scores(q_, c.k1, c.k2, p_, scale=scale, kernel1=sparse.kernel_size,
                                  stride1=sparse.kernel_stride, kernel2=sparse.kernel_size2,
                                  stride2=sparse.kernel_stride2, layer=i)[..., :64] for i in range(layers)]

    def attend_only(q_, c, p_, blocks):
        return [block_sparse_attention(q_, c.k, c.v, p_, c.lengths, blocks[i], scale=scale,
                                       block_size=sparse.block_size, layer=i) for i in range(layers)]

    blocks = jax.jit(select)(q, cache, pos)
    iters = 50
    print(f"  sparse decode attention L={length} ({layers} layers x {iters} calls)", file=sys.stderr, flush=True)
    # Dense and the decode path are timed by the loop's wall time and by its kernels' own time (a profile of
    # the same compiled loop): the wall time adds gaps between short kernels that vary by machine.
    loops = {n: device_loop(f, (q, cache, pos), iters=iters) for n, f in (("dense", dense), ("sparse", full))}
    seconds = {
        **{n: loop_time(run, (q, cache, pos), iters=iters, repeats=repeats) for n, run in loops.items()},
        "sparse_unfused": device_loop_time(lambda *a: full(*a, fused=False), (q, cache, pos), iters=iters,
                                           repeats=repeats),
        "scores": device_loop_time(lambda *a: select(*a, scores_only=True), (q, cache, pos), iters=iters,
                                   repeats=repeats),
        "select": device_loop_time(select, (q, cache, pos), iters=iters, repeats=repeats),
        "select_xla_pool": device_loop_time(lambda *a: select(*a, pool_in_kernel=False), (q, cache, pos),
                                            iters=iters, repeats=repeats),
        "stage2": device_loop_time(lambda q_, c, b, p_: attend_only(q_, c, p_, b), (q, cache, blocks, pos),
                                   iters=iters, repeats=repeats),
    }
    per_layer = {n: [t / layers for t in ts] for n, ts in seconds.items()}
    kernels = {n: loop_kernel_time(run, (q, cache, pos), iters=iters) for n, run in loops.items()}
    kernel_per_layer = {n: None if t is None else t / layers for n, t in kernels.items()}
    print(f"    {per_layer}\n    kernels {kernel_per_layer}", file=sys.stderr, flush=True)
    selected = int(jnp.sum(blocks[0] >= 0)) // config.num_kv_heads
    return {"context": length, "layers": layers, "selected_blocks": selected, "seconds": per_layer,
            "kernel_seconds": kernel_per_layer}


def bench_sparse(config: ModelConfig, sparse: SparseConfig, prefill_contexts: list[int], decode_contexts: list[int],
                 chunk: int, dtype, repeats: int, decode_layers: int = 0) -> dict:
    return {
        "heads": [config.num_heads, config.num_kv_heads, config.head_dim],
        "sparse_config": {k: getattr(sparse, k) for k in ("kernel_size", "kernel_stride", "block_size", "window_size",
                                                          "topk", "init_blocks", "dense_len")},
        "prefill": [bench_sparse_prefill(config, sparse, c, chunk, dtype, repeats) for c in prefill_contexts],
        "decode": [bench_sparse_decode(config, sparse, c, dtype, repeats, decode_layers) for c in decode_contexts],
    }


def _ms(ts) -> str:
    return f"{1e3 * statistics.median(ts):.3f}"


def _us(ts) -> str:
    return f"{1e6 * statistics.median(ts):.1f}"


def sparse_markdown(r: dict) -> str:
    h, kvh, d = r["heads"]
    sc = r["sparse_config"]
    lines = [
        f"InfLLM-v2 attention, one layer ({h} q heads, {kvh} KV heads, head_dim {d}, bf16, batch 1); sparse_config "
        + ", ".join(f"{k} {v}" for k, v in sc.items()),
        "",
        "| prefill prompt | chunk | dense flash ms | sparse ms | speed-up | of which stage 1 ms | block selection ms "
        "(pooled in the kernel / in XLA) | stage 2 ms (window split / one block-sparse pass) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    med = statistics.median
    for p in r["prefill"]:
        s = p["seconds"]
        xla = f" / {1e3 * (med(s['select_xla_pool']) - med(s['scores'])):.3f}" if "select_xla_pool" in s else ""
        stage2 = f"{1e3 * (med(s['sparse']) - med(s['select'])):.3f}"
        if "sparse_unsplit" in s:
            stage2 += f" / {1e3 * (med(s['sparse_unsplit']) - med(s['select'])):.3f}"
        lines.append(f"| {p['context']} | {p['chunk']} | {_ms(s['dense'])} | {_ms(s['sparse'])} | "
                     f"{med(s['dense']) / med(s['sparse']):.2f}x | {_ms(s['scores'])} | "
                     f"{1e3 * (med(s['select']) - med(s['scores'])):.3f}{xla} | {stage2} |")
    lines += ["", "| decode context | blocks attended | dense flash-decoding µs | sparse µs (decode path) | speed-up | "
                  "kernel time µs, dense / sparse (speed-up) | general path µs | its stage 1 µs | its stage 1 + "
                  "selection µs (pooled in the kernel / in XLA) | its block-sparse kernel µs |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["decode"]:
        s = p["seconds"]
        xla = f" / {_us(s['select_xla_pool'])}" if "select_xla_pool" in s else ""
        general = _us(s["sparse_unfused"]) if "sparse_unfused" in s else "—"
        ks = p.get("kernel_seconds") or {}
        kernel = (f"{1e6 * ks['dense']:.1f} / {1e6 * ks['sparse']:.1f} ({ks['dense'] / ks['sparse']:.2f}x)"
                  if ks.get("dense") and ks.get("sparse") else "—")
        lines.append(f"| {p['context']} | {p['selected_blocks']} | {_us(s['dense'])} | {_us(s['sparse'])} | "
                     f"{med(s['dense']) / med(s['sparse']):.2f}x | {kernel} | {general} | {_us(s['scores'])} | "
                     f"{_us(s['select'])}{xla} | {_us(s['stage2'])} |")
    return "\n".join(lines)
