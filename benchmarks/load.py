"""The ``load`` scenario: ``load_model`` of a shape's random weights from Hugging Face safetensors and from
the native (Orbax) format."""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.shapes import SHAPES
from minicpm_jax.config import ModelConfig
from minicpm_jax.io.names import model_map
from minicpm_jax.model.loading import load_model


def write_random_hf_checkpoint(shape: str, path: str, dtype=jnp.bfloat16, shard_bytes: int = 4 * 1024**3) -> int:
    """Writes a random HF-named safetensors checkpoint of ``shape`` (content: one random block tiled,
    which is enough to time reading); returns its size in bytes."""
    import ml_dtypes

    from checkpoints_convert.common import ShardedSafetensorsWriter, atomic_output_dir, write_json

    config = ModelConfig.from_dict(SHAPES[shape])
    np_dtype = {jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16, jnp.dtype(jnp.float16): np.float16}.get(jnp.dtype(dtype), np.float32)
    block = (np.random.default_rng(0).standard_normal(1 << 24) * 0.02).astype(np_dtype)
    with atomic_output_dir(path, overwrite=True) as tmp:
        writer = ShardedSafetensorsWriter(tmp, shard_bytes)
        cmap = model_map(config, set())
        tensors = [(t.name, t.shape) for t in cmap.tensors]
        tensors += [item for lin in cmap.linears for item in zip(lin.weight_names, lin.weight_shapes)]
        for name, shp in tensors:
            writer.add(name, np.resize(block, shp))
        writer.close()
        write_json(f"{tmp}/config.json", config.to_hf_dict())
    return writer.total_bytes


def bench_load(shape: str, scratch: str, dtype, repeats: int) -> dict:
    """Seconds to ``load_model`` the same random weights from HF safetensors and from the native format."""
    from checkpoints_convert.hf import convert_hf

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
