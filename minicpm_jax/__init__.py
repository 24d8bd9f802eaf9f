"""minicpm-jax: a JAX/Pallas inference engine for MiniCPM4 / MiniCPM4.1 and Llama-family models.

Quick use (the demo model; any Hugging Face MiniCPM4 / Llama directory works the same way)::

    import jax.numpy as jnp
    from minicpm_jax import Engine, encode_prompt, load_model, load_tokenizer, stop_token_ids
    from minicpm_jax.cli.demo import ensure_demo_model

    path = ensure_demo_model()
    model = load_model(path, dtype=jnp.float32, max_length=512)
    tok = load_tokenizer(path)
    engine = Engine(model, chunk_length=256)
    [result], stats = engine.generate([encode_prompt(tok, "Hello!")], max_new_tokens=32,
                                      stop_token_ids=stop_token_ids(model.config, tok, path))
    print(tok.decode(result.token_ids, skip_special_tokens=True))

``docs/architecture.md`` maps the packages: ``model`` and ``infllm`` (the network), ``io`` (checkpoints),
``engine`` (generation, scheduling, speculative decoding), ``cli`` (run, server, perplexity).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public names and the modules that define them. They are imported on first use (PEP 562), so
# ``python -m minicpm_jax.run`` reaches its Ctrl-C handler before JAX and the model code are imported.
_EXPORTS = {
    "minicpm_jax.config": ("DraftSpec", "ModelConfig", "SparseConfig"),
    "minicpm_jax.rope_config": ("RopeConfig",),
    "minicpm_jax.engine.engine": ("Engine", "GenerationResult", "GenerationStats"),
    "minicpm_jax.engine.sampling": ("SamplingParams",),
    "minicpm_jax.engine.scheduler": ("Request", "Scheduler"),
    "minicpm_jax.engine.speculative.engine": ("EagleSteps", "SpeculativeEngine"),
    "minicpm_jax.engine.speculative.rounds": ("SpecConfig",),
    "minicpm_jax.errors": ("MiniCPMError",),
    "minicpm_jax.io.frspec": ("read_frspec",),
    "minicpm_jax.model.cache": ("KVCache",),
    "minicpm_jax.model.causal_lm": ("MiniCPMForCausalLM",),
    "minicpm_jax.model.draft": ("EagleDraft",),
    "minicpm_jax.model.loading": ("load_draft", "load_model", "save_draft", "save_native"),
    "minicpm_jax.quant": ("QuantSpec",),
    "minicpm_jax.tokenizer": ("StreamDecoder", "encode_prompt", "load_tokenizer", "stop_token_ids"),
    "minicpm_jax.train.objective": ("Objective",),
    "minicpm_jax.train.trainer": ("DraftTrainer", "TrainConfig"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what static tools see
    from minicpm_jax.config import DraftSpec, ModelConfig, SparseConfig
    from minicpm_jax.rope_config import RopeConfig
    from minicpm_jax.engine.engine import Engine, GenerationResult, GenerationStats
    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.engine.scheduler import Request, Scheduler
    from minicpm_jax.engine.speculative.engine import EagleSteps, SpeculativeEngine
    from minicpm_jax.engine.speculative.rounds import SpecConfig
    from minicpm_jax.errors import MiniCPMError
    from minicpm_jax.io.frspec import read_frspec
    from minicpm_jax.model.cache import KVCache
    from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
    from minicpm_jax.model.draft import EagleDraft
    from minicpm_jax.model.loading import load_draft, load_model, save_draft, save_native
    from minicpm_jax.quant import QuantSpec
    from minicpm_jax.tokenizer import StreamDecoder, encode_prompt, load_tokenizer, stop_token_ids
    from minicpm_jax.train.objective import Objective
    from minicpm_jax.train.trainer import DraftTrainer, TrainConfig


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'minicpm_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

__all__ = [
    "DraftSpec",
    "DraftTrainer",
    "EagleDraft",
    "EagleSteps",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "KVCache",
    "MiniCPMError",
    "MiniCPMForCausalLM",
    "ModelConfig",
    "Objective",
    "QuantSpec",
    "Request",
    "RopeConfig",
    "SamplingParams",
    "Scheduler",
    "SparseConfig",
    "SpecConfig",
    "SpeculativeEngine",
    "StreamDecoder",
    "TrainConfig",
    "encode_prompt",
    "load_draft",
    "load_model",
    "load_tokenizer",
    "read_frspec",
    "save_draft",
    "save_native",
    "stop_token_ids",
]
