"""``python -m minicpm_jax.train_eagle``: trains an EAGLE draft for a target the engine loads.

    python -m minicpm_jax.train_eagle --target DIR --data FILE_OR_DIR --out DRAFT_DIR
    python -m minicpm_jax.train_eagle --prompts P.txt --data distill.jsonl --out DRAFT_DIR   # demo target

With ``--prompts`` and a ``--data`` file that does not exist yet, the target first answers the prompts
(self-distillation, :mod:`minicpm_jax.train.distill`) into that file; later runs reuse it. The draft is
written to ``--out`` in a layout ``--draft_path`` reads (with ``freq_<V>.npy`` for ``--frspec_path`` when
``--draft_vocab`` gives an EAGLE-1/2 draft an FR-Spec subset) and ``training.json`` (settings, data,
throughput, held-out metrics). Checkpoints go to ``--checkpoint_dir`` (default ``<out>.ckpt``): run the
same command again to resume an interrupted run. Accepts the model flags of ``minicpm_jax.run`` for the
target (``--dtype``, ``--quant``, ``--attention_impl``, ``--sparse``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

from absl import app, flags

from minicpm_jax.cli.flags import apply_system_flags, dtype_from_flags, fail
from minicpm_jax.config import DRAFT_KINDS
from minicpm_jax.errors import MiniCPMError

FLAGS = flags.FLAGS
_T = "train"
flags.DEFINE_string("target", None, "The target model (HF / native directory or a .gguf file); omitted: "
                    "--model_path, else the SmolLM2 demo model.", module_name=_T)
flags.DEFINE_string("data", None, "Training data: .jsonl (prompt_ids/answer_ids, messages or text records) or "
                    ".txt files, or a directory of them; with --prompts, where the self-distilled data goes.",
                    module_name=_T)
flags.DEFINE_string("prompts", None, "Self-distillation prompts (.txt one per line, or .jsonl with prompt / "
                    "messages); 'packaged' = the 640 chat prompts shipped with minicpm-jax.", module_name=_T)
flags.DEFINE_string("out", None, "The draft directory to write (must not exist).", module_name=_T)
flags.DEFINE_string("checkpoint_dir", None, "Orbax checkpoints (resumption); default <out>.ckpt.", module_name=_T)
flags.DEFINE_enum("kind", "auto", ["auto", *DRAFT_KINDS], "Draft architecture: auto = minicpm for MiniCPM "
                  "targets, llama (EAGLE-1/2) otherwise; eagle3 = EAGLE-3 with the training-time test.",
                  module_name=_T)
flags.DEFINE_integer("ttt_steps", None, "Unrolled draft steps per position (default: 1 for EAGLE-1/2, 4 for "
                     "EAGLE-3).", module_name=_T)
flags.DEFINE_integer("draft_vocab", 0, "EAGLE-3: the draft vocabulary (most frequent trained tokens); EAGLE-1/2: "
                     "an FR-Spec subset to train over and write as freq_<V>.npy. 0 = the whole vocabulary.",
                     module_name=_T)
flags.DEFINE_integer("seq_len", 512, "Tokens per training sequence (longer ones are cut).", module_name=_T)
flags.DEFINE_integer("batch_size", 16, "Sequences per step (a multiple of the devices).", module_name=_T)
flags.DEFINE_integer("steps", 2000, "Optimizer steps.", module_name=_T)
flags.DEFINE_float("learning_rate", 3e-4, "AdamW peak learning rate (warm-up, then cosine to a tenth).",
                   module_name=_T)
flags.DEFINE_integer("warmup_steps", 100, "Linear warm-up steps.", module_name=_T)
flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.", module_name=_T)
flags.DEFINE_float("grad_clip", 0.5, "Global gradient-norm clipping (0 = none).", module_name=_T)
flags.DEFINE_float("feature_noise", None, "Width of the uniform noise on the target features (default 0.2 for "
                   "EAGLE-1/2, 0 for EAGLE-3).", module_name=_T)
flags.DEFINE_integer("eval_every", 200, "Steps between held-out evaluations (0 = at the end).", module_name=_T)
flags.DEFINE_integer("save_every", 500, "Steps between checkpoints (0 = at the end).", module_name=_T)
flags.DEFINE_float("heldout_fraction", 0.05, "Share of the sequences held out for evaluation.", module_name=_T)
flags.DEFINE_integer("seed", 0, "Initialisation, data order and noise.", module_name=_T)
flags.DEFINE_integer("devices", 0, "Data-parallel devices (0 = every local accelerator; 1 on a CPU).",
                     module_name=_T)
flags.DEFINE_enum("layout", "cpmcu", ["cpmcu", "vllm"], "Tensor names of the written draft: cpmcu (CPM.cu / "
                  "SafeAILab, EAGLE-3 included) or vllm (MiniCPM drafts, with the target's embedding and head).",
                  module_name=_T)
flags.DEFINE_enum("save_dtype", "bfloat16", ["bfloat16", "float32"], "dtype of the written draft.", module_name=_T)
flags.DEFINE_integer("distill_samples", 1, "Answers per prompt: the first greedy, the others sampled.",
                     module_name=_T)
flags.DEFINE_float("distill_temperature", 0.8, "Temperature of the sampled answers.", module_name=_T)
flags.DEFINE_integer("distill_max_new_tokens", 384, "Longest answer.", module_name=_T)
flags.DEFINE_integer("distill_batch_size", 32, "Prompts answered at once.", module_name=_T)
flags.DEFINE_boolean("progress", True, "Progress bars on stderr.", module_name=_T)


def _check_flags() -> None:
    if not FLAGS.out:
        raise MiniCPMError("--out (the draft directory to write) is required")
    if os.path.exists(FLAGS.out):
        raise MiniCPMError(f"--out {FLAGS.out!r} already exists")
    if not FLAGS.data:
        raise MiniCPMError("--data is required (with --prompts: where the self-distilled data goes)")
    if not FLAGS.prompts:  # nothing to generate: the data must be there before the target loads
        from minicpm_jax.train.data import data_files

        data_files(FLAGS.data)
    if FLAGS.seq_len < 16:
        raise MiniCPMError(f"--seq_len must be >= 16, got {FLAGS.seq_len}")
    for name in ("distill_batch_size", "distill_max_new_tokens", "distill_samples"):
        if getattr(FLAGS, name) < 1:
            raise MiniCPMError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.devices < 0 or FLAGS.draft_vocab < 0:
        raise MiniCPMError("--devices and --draft_vocab must be >= 0")


def _devices():
    import jax

    if FLAGS.devices == 0:
        return jax.local_devices()[:1] if jax.default_backend() == "cpu" else jax.local_devices()
    if FLAGS.devices > len(jax.local_devices()):
        raise MiniCPMError(f"--devices {FLAGS.devices}: only {len(jax.local_devices())} local devices")
    return jax.local_devices()[: FLAGS.devices]


def _distill(model, tokenizer, model_path: str) -> dict:
    from minicpm_jax.engine.engine import Engine
    from minicpm_jax.tokenizer import stop_token_ids
    from minicpm_jax.train.distill import PACKAGED_PROMPTS, read_prompts, self_distill

    path = FLAGS.prompts
    if path == "packaged":
        path = os.path.join(PACKAGED_PROMPTS, "train_prompts.txt")
    prompts = read_prompts(path)
    engine = Engine(model, batch_size=FLAGS.distill_batch_size, chunk_length=min(512, model.max_length))
    stats = self_distill(engine, tokenizer, prompts, FLAGS.data, max_new_tokens=FLAGS.distill_max_new_tokens,
                         seq_len=FLAGS.seq_len, stop_ids=stop_token_ids(model.config, tokenizer, model_path),
                         samples=FLAGS.distill_samples, temperature=FLAGS.distill_temperature,
                         progress=FLAGS.progress)
    print(f"self-distilled {stats['records']} answers ({stats['answer_tokens']} tokens, "
          f"{stats['tokens_per_s']:.0f} tokens/s) into {FLAGS.data}", file=sys.stderr, flush=True)
    return stats


def train() -> dict:
    """The whole run (see the module doc); returns what ``training.json`` records."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minicpm_jax.cli.demo import resolve_model_path
    from minicpm_jax.model.loading import load_model, save_draft
    from minicpm_jax.tokenizer import load_tokenizer, stop_token_ids
    from minicpm_jax.train.data import frequent_ids, pack, read_examples, split_heldout
    from minicpm_jax.train.objective import Objective
    from minicpm_jax.train.trainer import DraftTrainer, TrainConfig, new_draft

    _check_flags()
    apply_system_flags()
    model_path = resolve_model_path(FLAGS.target or FLAGS.model_path, progress=FLAGS.progress)
    model = load_model(model_path, dtype=jnp.dtype(dtype_from_flags()), max_length=FLAGS.seq_len,
                       attention_impl=FLAGS.attention_impl, quant=FLAGS.quant, group_size=FLAGS.quant_group_size,
                       sparse=FLAGS.sparse)
    tokenizer = load_tokenizer(model_path)
    record: dict = {"target": model_path, "flags": {f.name: f.value for f in FLAGS.get_flags_for_module(_T)}}
    if FLAGS.prompts and not os.path.exists(FLAGS.data):
        record["self_distillation"] = _distill(model, tokenizer, model_path)
    cfg = model.config
    data = pack(read_examples(FLAGS.data, tokenizer, cfg.vocab_size), FLAGS.seq_len)
    train_set, heldout = split_heldout(data, FLAGS.heldout_fraction, FLAGS.seed)
    record["data"] = {"sequences": len(train_set), "heldout_sequences": 0 if heldout is None else len(heldout),
                      "trained_tokens_per_epoch": train_set.trained_tokens()}
    ids = None
    if FLAGS.draft_vocab:
        ids = frequent_ids(train_set.token_counts(cfg.vocab_size), FLAGS.draft_vocab,
                           keep=stop_token_ids(cfg, tokenizer, model_path))
    draft = new_draft(model, None if FLAGS.kind == "auto" else FLAGS.kind, vocab_ids=ids, seed=FLAGS.seed)
    spec = draft.spec
    objective = Objective.for_kind(spec.kind, FLAGS.ttt_steps)
    if FLAGS.feature_noise is not None:
        objective = dataclasses.replace(objective, feature_noise=FLAGS.feature_noise)
    tcfg = TrainConfig(objective=objective, steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                       learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                       weight_decay=FLAGS.weight_decay, grad_clip=FLAGS.grad_clip, seed=FLAGS.seed,
                       eval_every=FLAGS.eval_every, save_every=FLAGS.save_every)
    checkpoints = FLAGS.checkpoint_dir or FLAGS.out.rstrip("/") + ".ckpt"
    trainer = DraftTrainer(model, draft, train_set, tcfg, heldout=heldout,
                           vocab_ids=ids if spec.kind != "eagle3" else None, checkpoint_dir=checkpoints,
                           devices=_devices())
    if trainer.step:
        print(f"resuming at step {trainer.step} of {tcfg.steps}", file=sys.stderr, flush=True)
    evals = []

    def log(rec: dict) -> None:
        from tqdm import tqdm

        evals.append(rec)
        train_loss = rec["train"].get("loss")
        tqdm.write(f"step {rec['step']}: train loss {train_loss if train_loss is None else round(train_loss, 4)}, "
                   f"held-out loss {rec['heldout']['loss']:.4f}, top-1 per step "
                   f"{' '.join(f'{t:.3f}' for t in rec['heldout']['top1'])}, accept estimate "
                   f"{rec['heldout']['accept']:.3f}", file=sys.stderr)
    try:
        record["training"] = trainer.run(progress=FLAGS.progress, log=log)
    except KeyboardInterrupt:  # the trainer has checkpointed this step
        print(f"\ninterrupted at step {trainer.step}: checkpoint in {checkpoints}; run the same command to resume",
              file=sys.stderr)
        sys.exit(130)
    record["evaluations"] = evals
    record.update(kind=spec.kind, devices=len(trainer.mesh.devices.flat), backend=jax.default_backend(),
                  draft_params=int(sum(np.size(x) for x in jax.tree.leaves(trainer.params))))
    tmp = FLAGS.out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(trainer.draft(), tmp, dtype=FLAGS.save_dtype, layout=FLAGS.layout, target=model)
    if ids is not None and spec.kind != "eagle3":
        np.save(os.path.join(tmp, f"freq_{FLAGS.draft_vocab}.npy"), ids)
    with open(os.path.join(tmp, "training.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, FLAGS.out)
    return record


def main(argv):
    from absl import logging

    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint step at INFO
    try:
        record = train()
    except MiniCPMError as e:
        fail(str(e))
    held = record["training"]["heldout"]
    note = (f"; held-out top-1 {held['top1'][0]:.3f}, accept estimate {held['accept']:.2f} tokens/round"
            if held else "")
    frspec = f" --frspec_path {FLAGS.out} --frspec_vocab_size {FLAGS.draft_vocab}" if (
        FLAGS.draft_vocab and record["kind"] != "eagle3") else ""
    print(f"{record['kind']} draft ({record['draft_params']:,} parameters) trained {record['training']['steps']} "
          f"steps at {record['training']['tokens_per_s']:.0f} tokens/s{note}")
    print(f"use it: --draft_path {FLAGS.out}{frspec}")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
