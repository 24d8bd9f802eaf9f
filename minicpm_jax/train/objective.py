"""The EAGLE training objectives, computed with the engine's own modules: the frozen target
(:class:`~minicpm_jax.model.causal_lm.MiniCPMForCausalLM`) gives the features and the distributions, the
:class:`~minicpm_jax.model.draft.EagleDraft` being trained is the one speculative decoding runs.

Draft input at index ``i`` of a sequence is the pair (token ``x[i+1]``, target feature ``f[i]``) at RoPE
position ``i`` — the pairs the engine's draft prefill reads — and its output ``h[i]`` is trained towards
what the target computes at position ``i + 1``:

* EAGLE-1/2 (``llama``, ``minicpm`` drafts): ``regression_weight · SmoothL1(h[i], f[i+1])`` (the target's
  final-normed hidden state) ``+ token_weight · CE(p[i+1], q[i])``, the cross-entropy of the draft's
  distribution ``q = softmax(lm_head(h))`` against the target's ``p`` (weights 1 and 0.1 as in EAGLE), with
  uniform noise on the input features (EAGLE's augmentation).
* EAGLE-3: the training-time test. Step 0 reads the target's captured features; step ``k`` reads token
  ``x[i+1+k]`` with the draft's own step ``k-1`` output at position ``i + k``, attending to the step-0 keys
  at indices ``<= i`` and to its own chain ``(1..k, i)`` — exactly what a draft-tree node at depth ``k``
  sees in a round — and is trained by cross-entropy against the target at ``i + 1 + k`` (no feature
  regression), averaged over the steps. EAGLE-1/2 drafts take the same unrolled steps when asked.

All steps run as one call of the draft per step over a throwaway cache of ``steps × T`` slots, the chain
expressed as the draft's tree-token mask (the cache's ``attend_tree``). The target distribution is taken
over a draft vocabulary (EAGLE-3's, or an FR-Spec subset) when one is given, renormalised over it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from minicpm_jax.engine.speculative.rounds import draft_log_probs
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import TreeInputs
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft


@dataclasses.dataclass(frozen=True)
class Objective:
    """steps: unrolled draft steps (1 = EAGLE-1/2's teacher forcing; EAGLE-3's training-time test: more).
    regression_weight / token_weight: the loss terms' weights. feature_noise: width of the uniform noise
    added to the target's features during training (0 = none)."""

    steps: int = 1
    regression_weight: float = 1.0
    token_weight: float = 0.1
    feature_noise: float = 0.2

    @classmethod
    def for_kind(cls, kind: str, steps: int | None = None) -> "Objective":
        """The papers' objective for a draft ``kind``: EAGLE-1/2 (1 step, regression + 0.1·CE, noise 0.2)
        or EAGLE-3 (``steps`` default 4, CE only, no noise)."""
        if kind == "eagle3":
            obj = cls(steps=4, regression_weight=0.0, token_weight=1.0, feature_noise=0.0)
        else:
            obj = cls()
        return obj if steps is None else dataclasses.replace(obj, steps=steps)

    def check(self) -> "Objective":
        if self.steps < 1:
            raise MiniCPMError(f"the training-time test needs at least 1 step, got {self.steps}")
        if self.regression_weight < 0 or self.token_weight < 0 or self.regression_weight + self.token_weight == 0:
            raise MiniCPMError("the loss weights must be >= 0 and not both 0")
        if self.feature_noise < 0:
            raise MiniCPMError(f"the feature noise must be >= 0, got {self.feature_noise}")
        return self


def target_pass(model: MiniCPMForCausalLM, tokens: jax.Array, lengths: jax.Array,
                capture: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The frozen target over ``tokens int32[B, T]`` (``lengths int32[B]`` real): (final-normed hidden
    ``[B, T, H]``, the draft's features ``[B, T, F]`` — the hidden itself, or the residual streams entering
    the ``capture`` layers, concatenated). No gradient flows back."""
    b, t = tokens.shape
    hidden, captured, _ = model.forward_features(tokens, model.new_cache(b, t), lengths, capture=capture)
    features = jnp.concatenate(captured, axis=-1) if captured else hidden
    return jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(features)


def shifted(x: jax.Array, k: int) -> jax.Array:
    """``x[:, k:]`` padded with zeros at the end back to T entries (axis 1)."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, k)
    return jnp.pad(x[:, k:], pad)


def step_mask(step: int, steps: int, t: int) -> np.ndarray:
    """``bool[T, steps·T]``: what step ``step``'s token at index ``i`` sees among the cache slots (step
    ``m``'s token ``j`` at slot ``m·T + j``): step-0 slots ``j <= i`` and the slots ``(m, i)``, ``1 <= m <= step``."""
    mask = np.zeros((t, steps * t), bool)
    mask[:, :t] = np.tril(np.ones((t, t), bool))
    for m in range(1, step + 1):
        mask[:, m * t : (m + 1) * t] |= np.eye(t, dtype=bool)
    return mask


def draft_unroll(model: MiniCPMForCausalLM, draft: EagleDraft, tokens: jax.Array, lengths: jax.Array,
                 features: jax.Array, steps: int) -> list[jax.Array]:
    """The draft's outputs ``[B, T, H]`` of each unrolled step (see the module doc). Step ``k``'s token at
    index ``i`` is real iff ``i + 1 + k < length``; every token sees at least its own key, so padding
    stays finite."""
    b, t = tokens.shape
    cache = draft.new_cache(b, steps * t)
    idx = jnp.arange(t, dtype=jnp.int32)
    prefix = jnp.zeros((b,), jnp.int32)
    outs, feat = [], features
    for k in range(steps):
        valid = idx[None, :] + 1 + k < lengths[:, None]
        mask = jnp.broadcast_to(jnp.asarray(step_mask(k, steps, t)), (b, t, steps * t))
        h, cache = draft(model.embed(shifted(tokens, 1 + k)), feat, jnp.broadcast_to(idx + k, (b, t)), valid, cache,
                         TreeInputs(prefix, mask, k * t), from_target=k == 0)
        outs.append(h)
        feat = h
    return outs


def losses(model: MiniCPMForCausalLM, draft: EagleDraft, tokens: jax.Array, lengths: jax.Array, starts: jax.Array,
           objective: Objective, *, vocab_ids: jax.Array | None = None, noise_key: jax.Array | None = None
           ) -> tuple[jax.Array, dict]:
    """The objective over a batch (``tokens int32[B, T]``, ``lengths`` / ``starts int32[B]``, see
    :mod:`minicpm_jax.train.data`): (scalar loss, metrics).

    vocab_ids ``int32[V']``: the draft vocabulary — EAGLE-3's (``draft.target_ids()``) or an FR-Spec subset
    of an EAGLE-1/2 draft (its head is then the target's rows of those ids). noise_key: the features'
    noise (None: none, as in evaluation). Metrics: ``loss``; ``ce`` and ``reg`` of step 0; ``top1`` (step
    ``k``'s greedy token is the target's, per step); ``accept`` — a chain estimate of tokens per round:
    1 + the expected run of consecutive steps whose greedy token is the target's (and the data's);
    ``weight``: the trained positions of step 0.
    """
    capture = draft.spec.capture
    hidden, features = target_pass(model, tokens, lengths, capture)
    target_logits = model.logits(hidden)  # [B, T, V] fp32
    target_tok = jnp.argmax(target_logits, axis=-1)
    own_head = draft.own_head
    if own_head:
        vocab_ids = draft.target_ids()
    head = None if (own_head or vocab_ids is None) else model.head_rows(vocab_ids)
    if vocab_ids is not None:
        target_logits = jnp.take(target_logits, vocab_ids, axis=-1)
    p = jax.nn.softmax(target_logits, axis=-1)
    if noise_key is not None and objective.feature_noise > 0:
        a = objective.feature_noise / 2
        features = features + jax.random.uniform(noise_key, features.shape, features.dtype, -a, a)
    outs = draft_unroll(model, draft, tokens, lengths, features, objective.steps)
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    total = jnp.float32(0.0)
    metrics: dict = {"top1": []}
    run = jnp.ones(tokens.shape, jnp.float32)
    accept = jnp.ones(tokens.shape, jnp.float32)
    w0 = None
    for k, h in enumerate(outs):
        pos = idx + 1 + k
        w = ((pos < lengths[:, None]) & (pos >= starts[:, None])).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(w), 1.0)
        q_log = draft_log_probs(model, draft, h, head)
        ce = jnp.sum(-jnp.sum(shifted(p, 1 + k) * q_log, axis=-1) * w) / n
        term = objective.token_weight * ce
        reg = jnp.float32(0.0)
        if objective.regression_weight > 0 and not own_head:
            err = optax.huber_loss(h.astype(jnp.float32), shifted(hidden, 1 + k).astype(jnp.float32), delta=1.0)
            reg = jnp.sum(jnp.mean(err, axis=-1) * w) / n
            term = term + objective.regression_weight * reg
        total = total + term
        guess = jnp.argmax(q_log, axis=-1)
        guess = guess if vocab_ids is None else vocab_ids[guess]
        want = shifted(target_tok, 1 + k)
        hit = (guess == want).astype(jnp.float32)
        metrics["top1"].append(jnp.sum(hit * w) / n)
        run = run * hit
        accept = accept + run
        # the next step reads the data's token: a chain of greedy drafts only if it is the target's too
        run = run * ((shifted(tokens, 2 + k) == want) & (pos + 1 < lengths[:, None])).astype(jnp.float32)
        if k == 0:
            metrics["ce"], metrics["reg"], w0 = ce, reg, w
    loss = total / len(outs)
    metrics["loss"] = loss
    metrics["weight"] = jnp.sum(w0)  # trained positions: what averages over batches weigh by
    metrics["accept"] = jnp.sum(accept * w0) / jnp.maximum(metrics["weight"], 1.0)
    return loss, metrics
