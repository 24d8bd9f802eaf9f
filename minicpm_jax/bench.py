"""Benchmarks: ``python -m minicpm_jax.bench --shape minicpm4-8b --contexts 1024,4096``.

End-to-end rows run the real engine (chunked prefill, on-device decode loop) on a named model shape with
random weights, and compare each number with a roofline measured in the same run:

* decode ms/token vs the weight-bytes roofline: bytes every decode step must read (all weights but the
  embedding table, which is gathered one row per token) ÷ the device-to-device copy bandwidth measured
  here (read + write bytes per second);
* prefill tok/s vs the matmul roofline: 2·params FLOPs per token ÷ a large bf16 matmul's FLOP/s.

``--scenarios load`` times ``load_model`` of a random-weight checkpoint of the shape written both as HF
safetensors and in the native Orbax format (``checkpoints_convert hf``) under ``--scratch_dir``.

Prints a markdown table last and writes everything as JSON (``--json_out``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from minicpm_jax.config import ModelConfig
from minicpm_jax.engine import Engine
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model import MiniCPMForCausalLM

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
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("scenarios", ["e2e"], "Which benchmarks: e2e (prefill + decode), load (HF vs native).")
flags.DEFINE_enum("shape", "minicpm4-8b", list(SHAPES), "Model shape (random weights).")
flags.DEFINE_string("scratch_dir", "/tmp/minicpm_jax_bench", "Where the load scenario writes its checkpoints.")
flags.DEFINE_list("contexts", ["1024"], "Context lengths (prompt tokens before decoding).")
flags.DEFINE_integer("batch_size", 1, "Sequences decoded together.")
flags.DEFINE_integer("decode_steps", 128, "Tokens decoded per timed run.")
flags.DEFINE_integer("decode_block", 32, "Decode steps per host round trip.")
flags.DEFINE_integer("chunk_length", 1024, "Prefill chunk length.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Weight/activation dtype.")
flags.DEFINE_integer("repeats", 2, "Timed repeats per row (all are reported, to show the spread).")
flags.DEFINE_integer("max_length", None, "Static cache length (default: largest context + decode_steps + 8).")
flags.DEFINE_string("json_out", None, "Write all results as JSON here.")
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


def decode_weight_bytes(config: ModelConfig, itemsize: int) -> int:
    """Bytes of weights one decode step reads: every parameter except the gathered embedding table
    (a tied head still reads the table once, as lm_head)."""
    params = config.num_params - (0 if config.tied_head else config.vocab_size * config.hidden_size)
    return params * itemsize


def random_model(config: ModelConfig, max_length: int, dtype) -> MiniCPMForCausalLM:
    """Random-weight model created directly on the default device."""
    from flax import nnx

    return MiniCPMForCausalLM(config, max_length=max_length, dtype=dtype, rngs=nnx.Rngs(0))


@dataclasses.dataclass
class Row:
    shape: str
    context: int
    batch_size: int
    max_length: int
    prefill_tok_s: list[float]
    decode_ms_per_token: list[float]
    roofline_ms: float
    prefill_roofline_tok_s: float

    @property
    def decode_ms(self) -> float:
        return statistics.median(self.decode_ms_per_token)

    @property
    def pct_roofline(self) -> float:
        return 100 * self.roofline_ms / self.decode_ms


def bench_end_to_end(shape: str, contexts: list[int], batch_size: int, decode_steps: int, decode_block: int,
                     chunk_length: int, dtype, repeats: int, bandwidth: float, flops: float,
                     max_length: int | None = None, dump_hlo: str | None = None) -> list[Row]:
    config = ModelConfig.from_dict(SHAPES[shape])
    max_length = max_length or max(contexts) + decode_steps + 8
    if max_length < max(contexts) + decode_steps:
        raise MiniCPMError(f"--max_length {max_length} is too small for context {max(contexts)} + {decode_steps} steps")
    model = random_model(config, max_length, dtype)
    engine = Engine(model, batch_size=batch_size, chunk_length=min(chunk_length, max_length), decode_block=decode_block)
    itemsize = jnp.dtype(dtype).itemsize
    wbytes = decode_weight_bytes(config, itemsize)
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
        prefill_roof = flops / (2 * config.num_params)
        rows.append(Row(shape, ctx, batch_size, max_length, pre, dec, roofline_ms, prefill_roof))
        print(f"  {shape} ctx={ctx}: decode {dec} ms/token (roofline {roofline_ms:.3f} ms), prefill {pre} tok/s",
              file=sys.stderr)
    return rows


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


def markdown(rows: list[Row], bandwidth: float, flops: float, device: str) -> str:
    lines = [
        f"device: {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; bf16 matmul {flops / 1e12:.0f} TFLOP/s",
        "",
        "| shape | batch | context | max_length | decode ms/token (runs) | roofline ms | % of roofline | prefill tok/s (runs) | % of matmul roofline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = ", ".join(f"{x:.3f}" for x in r.decode_ms_per_token)
        pre = ", ".join(f"{x:,.0f}" for x in r.prefill_tok_s)
        pct_pre = 100 * statistics.median(r.prefill_tok_s) / r.prefill_roofline_tok_s
        lines.append(f"| {r.shape} | {r.batch_size} | {r.context} | {r.max_length} | {r.decode_ms:.3f} ({runs}) | {r.roofline_ms:.3f} | "
                     f"{r.pct_roofline:.1f}% | {pre} | {pct_pre:.1f}% |")
    return "\n".join(lines)


def main(argv):
    del argv
    try:
        _main()
    except MiniCPMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _main():
    try:
        contexts = [int(c) for c in FLAGS.contexts]
    except ValueError:
        raise MiniCPMError(f"--contexts must be integers, got {FLAGS.contexts}") from None
    unknown = set(FLAGS.scenarios) - {"e2e", "load"}
    if unknown:
        raise MiniCPMError(f"--scenarios: unknown {', '.join(sorted(unknown))} (choose from e2e, load)")
    device = jax.devices()[0].device_kind
    result: dict = {"device": device, "jax": jax.__version__, "shape": FLAGS.shape}
    tables = []
    if "load" in FLAGS.scenarios:
        result["load"] = bench_load(FLAGS.shape, FLAGS.scratch_dir, jnp.dtype(FLAGS.dtype), FLAGS.repeats)
        tables.append(load_markdown(result["load"]))
    if "e2e" in FLAGS.scenarios:
        small = jax.default_backend() == "cpu"  # CPU numbers are for smoke runs only
        bandwidth = copy_bandwidth(256 * 1024**2 if small else 2 * 1024**3)
        flops = matmul_flops(1024 if small else 8192)
        rows = bench_end_to_end(FLAGS.shape, contexts, FLAGS.batch_size, FLAGS.decode_steps, FLAGS.decode_block,
                                FLAGS.chunk_length, jnp.dtype(FLAGS.dtype), FLAGS.repeats, bandwidth, flops,
                                FLAGS.max_length, FLAGS.dump_hlo)
        result.update(copy_bandwidth_Bps=bandwidth, matmul_flops=flops,
                      rows=[dict(dataclasses.asdict(r), pct_roofline=r.pct_roofline) for r in rows])
        tables.append(markdown(rows, bandwidth, flops, device))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print("\n\n".join(tables))


if __name__ == "__main__":
    app.run(main)
