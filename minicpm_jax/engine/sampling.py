"""Token sampling on device: greedy, temperature, top-k, top-p, with per-row reproducible keys.

Every row carries its own parameters as data (no recompilation when they change) and its own key; the
key for a row's n-th token is ``fold_in(row_key, n)``, so a sequence samples the same tokens whether it
runs alone or in a batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minicpm_jax.errors import MiniCPMError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters; seed fixes the draws."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise MiniCPMError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise MiniCPMError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MiniCPMError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise MiniCPMError(f"seed must be in [0, 2**64), got {self.seed}")


SAMPLING_KINDS = ("auto", "greedy", "temperature", "filtered")
TOP_LOGPROBS = 20  # alternatives a step returns when log-probabilities are asked for (OpenAI's top_logprobs limit)


def sampling_kind(params) -> str:
    """The static sampling path a batch of :class:`SamplingParams` needs: ``greedy`` (all rows greedy:
    argmax only), ``temperature`` (no top-k / top-p filter on any sampled row), else ``filtered``. Engines
    compile one step per kind, so the step holds no conditional (on a GPU a conditional waits for the
    device and re-launches the rest of the step from the host)."""
    stochastic = [p for p in params if p.temperature > 0]
    if not stochastic:
        return "greedy"
    return "filtered" if any(p.top_k > 0 or p.top_p < 1.0 for p in stochastic) else "temperature"


def row_key(seed: int) -> np.ndarray:
    """The raw ``uint32[2]`` key of a row with this 64-bit seed: its high and low words, which is what
    ``jax.random.PRNGKey`` (threefry) builds from a seed with ``jax_enable_x64``. Written out because
    without x64 that function keeps only the low 32 bits and refuses seeds from 2**63 (OpenAI clients
    send up to 2**64 - 1). A host array: a batch's keys go to the device together, in one transfer."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside the top-k, then outside the top-p nucleus (of the renormalised top-k), to -inf.

    logits ``f32[B, V]``, top_k ``int32[B]`` (0 = off), top_p ``f32[B]`` (1 = off). Ties at a threshold
    are kept.
    """
    vocab = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(vocab)[None, :]
    desc_k = jnp.where(ranks < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc_k, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = jnp.sum((mass_before < top_p[:, None]) & (ranks < k[:, None]), axis=-1)  # >= 1
    threshold = jnp.take_along_axis(desc, (keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(
    logits: jax.Array,
    keys: jax.Array,
    steps: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    kind: str = "auto",
) -> jax.Array:
    """Draws one token per row.

    logits ``f32[B, V]``; keys ``uint32[B, 2]``; steps ``int32[B]`` (index of the token being drawn);
    temperature ``f32[B]``; top_k ``int32[B]``; top_p ``f32[B]``. Returns ``int32[B]``.
    kind (static, :func:`sampling_kind`): ``greedy`` / ``temperature`` / ``filtered`` compile only that
    path (valid when the rows' parameters need no more); ``auto`` decides on device.
    """
    if kind not in SAMPLING_KINDS:
        raise ValueError(f"sampling kind must be one of {SAMPLING_KINDS}, got {kind!r}")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if kind == "greedy":
        return greedy
    stochastic = temperature > 0
    scaled = logits / jnp.where(stochastic, temperature, 1.0)[:, None]
    if kind == "filtered":
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    elif kind == "auto":
        needs_filter = jnp.any(stochastic & ((top_k > 0) | (top_p < 1.0)))
        scaled = jax.lax.cond(needs_filter, filter_top_k_top_p, lambda x, *_: x, scaled, top_k, top_p)
    step_keys = jax.vmap(jax.random.fold_in)(keys, steps)
    drawn = jax.vmap(jax.random.categorical)(step_keys, scaled).astype(jnp.int32)
    return jnp.where(stochastic, drawn, greedy)


def token_logprobs(logits: jax.Array, tok: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the model's distribution ``softmax(logits)`` (before temperature and filters,
    as vLLM reports them): of the chosen ``tok int32[B]`` (``f32[B]``), and the ``k`` most likely tokens
    (ids ``int32[B, k]`` and ``f32[B, k]``, most likely first). logits ``f32[B, V]``."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tok[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_ids.astype(jnp.int32), top_lp
