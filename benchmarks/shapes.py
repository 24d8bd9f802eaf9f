"""The model shapes benchmarks run (random weights), the ceilings every number is set against — a
device-to-device copy and a large bf16 matmul, measured in the same run — and the roofline arithmetic."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.config import ModelConfig
from minicpm_jax.io.names import decoder_layer_linears
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.loading import shard_model
from minicpm_jax.quant import QuantSpec


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


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``{name: (K, N)}`` of one decoder layer's (fused) linears: qkv, o, gate_up, down."""
    names = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
    return {names[lin.path[-1]]: (lin.in_features, sum(lin.widths)) for lin in decoder_layer_linears(config, "", (), set())}


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
                 quant: QuantSpec | None = None, sparse: str = "off", mesh=None) -> MiniCPMForCausalLM:
    """Random-weight model created on the default device (the same weights for every backend), then split
    over ``mesh`` when given (tensor parallelism)."""
    model = MiniCPMForCausalLM(config, max_length=max_length, dtype=dtype, attention_impl=attention_impl,
                               rngs=nnx.Rngs(0), quant=quant, sparse=sparse)
    return model if mesh is None else shard_model(model, mesh)
