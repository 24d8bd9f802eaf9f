"""The EAGLE draft trainer: the target frozen and its features taken in the same jit as the draft's loss
(:mod:`minicpm_jax.train.objective`), AdamW (optax) with warm-up and cosine decay, data parallel over the
given devices (the batch split over a ``data`` mesh axis, the draft and the target replicated; XLA reduces
the gradients), Orbax checkpoints of the draft and the optimizer every ``save_every`` steps, and resumption
from the newest one — the batches are a pure function of (seed, step), so a resumed run continues exactly
where it stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from minicpm_jax.config import DraftSpec
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.train.data import Sequences, batch_rows
from minicpm_jax.train.objective import Objective, losses

CONFIG_FILE = "train_config.json"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """steps: optimizer steps in all (a resumed run goes on to this); batch_size: sequences per step (a
    multiple of the devices); learning_rate: AdamW's peak, reached after ``warmup_steps`` and decayed by
    a cosine to a tenth; grad_clip: global-norm clipping (0 = none); eval_every / save_every: steps
    between held-out evaluations / checkpoints (0 = only at the end); eval_batches: held-out batches per
    evaluation; eval_steps: depth of the chain the accept-length estimate unrolls."""

    objective: Objective = Objective()
    steps: int = 1000
    batch_size: int = 8
    learning_rate: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    eval_every: int = 200
    save_every: int = 500
    eval_batches: int = 8
    eval_steps: int = 3

    def check(self) -> "TrainConfig":
        self.objective.check()
        for name in ("steps", "batch_size", "eval_batches", "eval_steps"):
            if getattr(self, name) < 1:
                raise MiniCPMError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise MiniCPMError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise MiniCPMError(f"learning_rate must be > 0, got {self.learning_rate}")
        return self

    def resume_settings(self) -> dict:
        """The settings a resumed run must share with the run it continues (all but the step count and
        the evaluation / checkpoint cadence)."""
        out = dataclasses.asdict(self)
        for key in ("steps", "eval_every", "save_every", "eval_batches", "eval_steps"):
            out.pop(key)
        return out


def new_draft(target: MiniCPMForCausalLM, kind: str | None = None, *, vocab_ids: np.ndarray | None = None,
              seed: int = 0) -> EagleDraft:
    """A randomly initialised float32 draft of ``kind`` (default: ``minicpm`` for MiniCPM targets, ``llama``
    otherwise) for ``target``, on the reference kernels (their gradients are defined). ``vocab_ids
    int32[V']``: an EAGLE-3 draft's vocabulary (its head gets V' rows and ``d2t`` maps them; ignored for
    EAGLE-1/2 drafts, whose FR-Spec subset is the trainer's ``vocab_ids``)."""
    eagle3 = kind == "eagle3"
    size = None if vocab_ids is None or not eagle3 else int(vocab_ids.shape[0])
    spec = DraftSpec.for_target(target.config, kind, draft_vocab=size)
    draft = EagleDraft(spec, max_length=target.max_length, attention_impl="xla", dtype=jnp.float32,
                       rngs=nnx.Rngs(seed))
    if eagle3 and vocab_ids is not None:
        ids = np.sort(np.asarray(vocab_ids))
        draft.d2t.set_value(jnp.asarray(ids - np.arange(ids.shape[0]), jnp.int32))
    return draft


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (β 0.9 / 0.95) under a linear warm-up and a cosine decay to a tenth of the peak, after
    global-norm clipping."""
    decay = max(cfg.steps, cfg.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, decay,
                                                  end_value=cfg.learning_rate * 0.1)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def _loss_fn(tgraph, dgraph, seed: int, objective: Objective, noise: bool) -> Callable:
    def loss(params, rest, tstate, vocab_ids, tokens, lengths, starts, step):
        model, draft = nnx.merge(tgraph, tstate), nnx.merge(dgraph, params, rest)
        key = jax.random.fold_in(jax.random.key(seed), step) if noise else None
        return losses(model, draft, tokens, lengths, starts, objective, vocab_ids=vocab_ids, noise_key=key)
    return loss


@functools.lru_cache(maxsize=8)
def _programs(tgraph, dgraph, cfg: TrainConfig) -> tuple[Callable, Callable, Callable, Callable]:
    """The jitted (optimizer init, train step, training loss, held-out loss) of a target / draft structure
    and settings;
    cached, so trainers of the same shapes (a resumed run in the same process) share their compilations."""
    loss = _loss_fn(tgraph, dgraph, cfg.seed, cfg.objective, noise=True)
    optimizer = make_optimizer(cfg)
    eval_objective = dataclasses.replace(cfg.objective, steps=max(cfg.objective.steps, cfg.eval_steps))

    def train_step(params, opt_state, rest, tstate, vocab_ids, tokens, lengths, starts, step):
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        (_, metrics), grads = grad_fn(params, rest, tstate, vocab_ids, tokens, lengths, starts, step)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return (jax.jit(optimizer.init), jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(loss),
            jax.jit(_loss_fn(tgraph, dgraph, cfg.seed, eval_objective, noise=False)))


class DraftTrainer:
    """Trains ``draft`` against the frozen ``model`` on ``train`` sequences.

    heldout: sequences for the evaluations (None: none); vocab_ids ``int32[V']``: an FR-Spec subset for an
    EAGLE-1/2 draft (an EAGLE-3 draft's vocabulary is its own ``d2t``); checkpoint_dir: where Orbax keeps
    the checkpoints (None: no checkpoints, no resumption); devices: the data-parallel devices (default:
    the first local device).
    """

    def __init__(self, model: MiniCPMForCausalLM, draft: EagleDraft, train: Sequences, cfg: TrainConfig, *,
                 heldout: Sequences | None = None, vocab_ids: np.ndarray | None = None,
                 checkpoint_dir: str | None = None, devices: list | None = None):
        self.cfg = cfg.check()
        devices = list(devices or jax.local_devices()[:1])
        if cfg.batch_size % len(devices):
            raise MiniCPMError(f"the batch size {cfg.batch_size} must be a multiple of the {len(devices)} devices")
        if model.mesh is not None:
            raise MiniCPMError("train the draft against an unsplit target (data parallelism splits the batch)")
        self.mesh = Mesh(np.asarray(devices), ("data",))
        self.replicated = NamedSharding(self.mesh, P())
        self.split_rows = NamedSharding(self.mesh, P("data"))
        self.train_data, self.heldout = train, heldout
        self.tgraph, tstate = nnx.split(model)
        self.tstate = jax.device_put(tstate, self.replicated)
        self.dgraph, params, rest = nnx.split(draft, nnx.Param, ...)
        self.params = jax.device_put(params, self.replicated)
        self.rest = jax.device_put(rest, self.replicated)
        self.vocab_ids = None if vocab_ids is None else jax.device_put(jnp.asarray(vocab_ids, jnp.int32),
                                                                       self.replicated)
        init, self._train_step, self._loss, self._eval_step = _programs(self.tgraph, self.dgraph, cfg)
        self.opt_state = init(self.params)
        self.step = 0
        self.manager = None
        if checkpoint_dir is not None:
            self.manager = self._open_checkpoints(checkpoint_dir)

    def _place(self, b: Sequences) -> tuple:
        """(tokens, lengths, starts) of ``b``, split over the mesh's ``data`` axis."""
        return tuple(jax.device_put(x, self.split_rows) for x in (b.tokens, b.lengths, b.starts))

    # ------------------------------------------------------------------ public
    def loss_and_metrics(self, rows: np.ndarray, data: Sequences | None = None, step: int = 0) -> tuple[float, dict]:
        """The training loss (noise of ``step``) and metrics of ``rows`` of ``data`` (default: the training
        set) at the current parameters, without updating them."""
        loss, metrics = self._loss(self.params, self.rest, self.tstate, self.vocab_ids,
                           *self._place((data or self.train_data).rows(rows)), jnp.int32(step))
        return float(loss), jax.tree.map(np.asarray, metrics)

    def evaluate(self) -> dict:
        """Held-out metrics (no noise), weighted by trained positions: ``top1`` per unrolled step and the
        chain ``accept`` estimate (tokens per round of a one-wide tree ``eval_steps`` deep); {} without
        held-out data."""
        if self.heldout is None:
            return {}
        n, bs = len(self.heldout), self.cfg.batch_size
        sums: dict = {}
        weight = 0.0
        for i in range(min(self.cfg.eval_batches, -(-n // bs))):
            rows = np.arange(i * bs, (i + 1) * bs) % n
            rows_real = np.arange(i * bs, (i + 1) * bs) < n
            data = self.heldout.rows(rows)
            data.lengths = np.where(rows_real, data.lengths, 0).astype(np.int32)  # padding rows weigh nothing
            _, m = self._eval_step(self.params, self.rest, self.tstate, self.vocab_ids, *self._place(data),
                                   jnp.int32(0))
            w = float(m["weight"])
            weight += w
            for key in ("accept", "loss"):
                sums[key] = sums.get(key, 0.0) + float(m[key]) * w
            sums["top1"] = [a + float(b) * w for a, b in zip(sums.get("top1", [0.0] * len(m["top1"])), m["top1"])]
        weight = max(weight, 1.0)
        return {"loss": sums["loss"] / weight, "accept": sums["accept"] / weight,
                "top1": [t / weight for t in sums["top1"]]}

    def run(self, *, progress: bool = True, log: Callable[[dict], None] | None = None) -> dict:
        """Trains from the current step to ``cfg.steps``: returns a summary (steps, seconds, trained tokens
        per second after the first step's compilation, the last training metrics and held-out metrics).
        ``log(record)`` receives each evaluation. Ctrl-C saves a checkpoint before it propagates."""
        from tqdm import tqdm

        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress, file=sys.stderr, desc="train",
                   dynamic_ncols=True)
        last: dict = {}
        evals: dict = {}
        t_start, tokens_done, t_first = time.perf_counter(), 0, None
        try:
            while self.step < cfg.steps:
                rows = batch_rows(len(self.train_data), cfg.batch_size, self.step, cfg.seed)
                batch = self._place(self.train_data.rows(rows))
                self.params, self.opt_state, metrics = self._train_step(
                    self.params, self.opt_state, self.rest, self.tstate, self.vocab_ids, *batch, jnp.int32(self.step))
                self.step += 1
                if t_first is None:
                    jax.block_until_ready(self.params)
                    t_first = time.perf_counter()
                else:
                    tokens_done += int(np.sum(self.train_data.lengths[rows]))
                done = self.step == cfg.steps
                if self.step % 10 == 0 or done:
                    last = {"loss": float(metrics["loss"]), "top1": float(metrics["top1"][0]),
                            "accept": float(metrics["accept"])}
                    bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{last['top1']:.2f}", refresh=False)
                if cfg.eval_every and self.step % cfg.eval_every == 0 or done:
                    evals = self.evaluate()
                    if evals:
                        bar.set_postfix(loss=f"{last.get('loss', float('nan')):.3f}",
                                        heldout_top1=f"{evals['top1'][0]:.3f}", accept=f"{evals['accept']:.2f}",
                                        refresh=False)
                        if log:
                            log({"step": self.step, "train": last, "heldout": evals})
                if self.manager is not None and (cfg.save_every and self.step % cfg.save_every == 0 or done):
                    self.save()
                bar.update(1)
        except KeyboardInterrupt:
            if self.manager is not None:
                self.save()
            raise
        finally:
            bar.close()
        seconds = time.perf_counter() - t_start
        steady = time.perf_counter() - t_first if t_first else 0.0
        return {"steps": self.step, "seconds": seconds, "tokens_per_s": tokens_done / steady if steady > 0 else 0.0,
                "train": last, "heldout": evals}

    def draft(self) -> EagleDraft:
        """The draft with the current parameters (on the host's first device, ready to save or run)."""
        params, rest = jax.device_get((self.params, self.rest))
        return nnx.merge(self.dgraph, params, rest)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state, "step": jnp.int32(self.step)}

    def _open_checkpoints(self, directory: str):
        import orbax.checkpoint as ocp

        directory = os.path.abspath(directory)
        settings = json.loads(json.dumps(self.cfg.resume_settings()))
        config_path = os.path.join(directory, CONFIG_FILE)
        manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False))
        latest = manager.latest_step()
        if latest is None:
            tmp = config_path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(settings, f, indent=1)
            os.replace(tmp, config_path)
            return manager
        try:
            with open(config_path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            raise MiniCPMError(f"{directory} holds checkpoints without a readable {CONFIG_FILE}: remove it to "
                               "start afresh") from None
        changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        if changed:
            raise MiniCPMError(f"{directory} holds a run with other settings ({', '.join(changed)}): resume with "
                               "the same settings, or give another checkpoint directory")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._state())
        restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
        self.params = jax.device_put(restored["params"], self.replicated)
        self.opt_state = jax.device_put(restored["opt_state"], self.replicated)
        self.step = int(restored["step"])
        return manager

    def save(self) -> None:
        """A checkpoint of the current step (kept: the newest two)."""
        import orbax.checkpoint as ocp

        if self.manager is None:
            raise MiniCPMError("this trainer has no checkpoint directory")
        if self.manager.latest_step() != self.step:
            self.manager.save(self.step, args=ocp.args.StandardSave(self._state()))
            self.manager.wait_until_finished()
