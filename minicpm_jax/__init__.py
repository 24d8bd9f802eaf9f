"""minicpm-jax: a JAX/Pallas inference engine for MiniCPM4 / MiniCPM4.1 and Llama-family models.

Quick use::

    import jax.numpy as jnp
    from minicpm_jax import Engine, SamplingParams, load_model, load_tokenizer, encode_prompt

    model = load_model("path/to/hf_dir", dtype=jnp.bfloat16, max_length=4096)
    tok = load_tokenizer("path/to/hf_dir")
    engine = Engine(model, chunk_length=256)
    [result], stats = engine.generate([encode_prompt(tok, "Hello!")], max_new_tokens=64)
    print(tok.decode(result.token_ids))
"""

from minicpm_jax.cache import KVCache
from minicpm_jax.config import ModelConfig, RopeConfig, SparseConfig
from minicpm_jax.eagle import DraftSpec, EagleDraft, load_draft, read_frspec
from minicpm_jax.engine import Engine, GenerationResult, GenerationStats
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model import MiniCPMForCausalLM
from minicpm_jax.sampling import SamplingParams
from minicpm_jax.speculative import SpecConfig, SpeculativeEngine
from minicpm_jax.tokenizer import StreamDecoder, encode_prompt, load_tokenizer, stop_token_ids
from minicpm_jax.weights import load_model

__version__ = "0.1.0"

__all__ = [
    "DraftSpec",
    "EagleDraft",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "KVCache",
    "MiniCPMError",
    "MiniCPMForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "SamplingParams",
    "SparseConfig",
    "SpecConfig",
    "SpeculativeEngine",
    "StreamDecoder",
    "encode_prompt",
    "load_draft",
    "load_model",
    "load_tokenizer",
    "read_frspec",
    "stop_token_ids",
]
