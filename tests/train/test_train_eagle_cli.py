"""``python -m minicpm_jax.train_eagle`` as a user runs it on the demo model: self-distillation, training,
a draft ``--draft_path`` loads, the one-line errors; chat and text records through the real tokenizer."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

TRAIN = [sys.executable, "-m", "minicpm_jax.train_eagle"]


def _train(*args):
    return subprocess.run(TRAIN + list(args), capture_output=True, text=True, timeout=900, env=os.environ)


@pytest.mark.smollm2
def test_self_distill_train_and_load_the_draft(smollm2_dir, tmp_path):
    import jax.numpy as jnp

    from minicpm_jax.config import ModelConfig
    from minicpm_jax.model.loading import load_draft

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nName a primary colour.\n")
    data, out = tmp_path / "distill.jsonl", tmp_path / "draft"
    args = ("--prompts", str(prompts), "--data", str(data), "--out", str(out), "--seq_len", "64", "--steps", "2",
            "--batch_size", "2", "--heldout_fraction", "0", "--save_every", "0", "--eval_every", "0",
            "--distill_max_new_tokens", "12", "--distill_samples", "2", "--distill_batch_size", "4",
            "--draft_vocab", "256", "--progress=false")
    r = _train(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(records) == 4 and records[0]["prompt"] == "What is the capital of France?"
    assert "Paris" in records[0]["answer"] and records[0]["answer_ids"][-1] == 2  # greedy, ends at <|im_end|>
    assert "llama draft (4,203,648 parameters) trained 2 steps" in r.stdout
    assert f"--draft_path {out} --frspec_path {out} --frspec_vocab_size 256" in r.stdout
    record = json.loads((out / "training.json").read_text())
    assert record["self_distillation"]["records"] == 4 and record["training"]["steps"] == 2
    ids = np.load(out / "freq_256.npy")
    assert ids.shape == (256,) and 2 in ids  # the stop id is always proposable
    draft = load_draft(str(out), ModelConfig.from_pretrained(smollm2_dir), max_length=64, attention_impl="xla",
                       dtype=jnp.float32)
    assert draft.spec.kind == "llama"
    assert (tmp_path / "draft.ckpt" / "2").is_dir()  # the final checkpoint: a longer --steps run resumes from it

    again = _train(*args)  # the draft exists: refused before anything loads
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [f"error: --out {str(out)!r} already exists"]
    bad = _train("--data", str(tmp_path / "nothing.jsonl"), "--out", str(tmp_path / "d2"), "--progress=false")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    missing = str(tmp_path / "nothing.jsonl")
    assert bad.stderr.strip().splitlines() == [f"error: training data {missing!r} does not exist"]


@pytest.mark.smollm2
def test_the_draft_benchmark_runs_the_shipped_draft(smollm2_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.draft", "--draft_path", "demo", "--prompts", "1",
                        "--num_generate", "8", "--spec_num_iters", "2", "--max_length", "256", "--json_out", str(out)],
                       capture_output=True, text=True, timeout=900, env=os.environ)
    assert r.returncode == 0, r.stderr[-3000:]
    plain, spec = json.loads(out.read_text())["rows"]
    assert plain["engine"] == "plain" and plain["prompts"] == 1 and plain["decode_tokens_per_s"] > 0
    assert spec["num_iter"] == 2 and spec["tree_size"] == 12 and spec["identical_answers"] == 1
    assert spec["mean_accept_length"] > 1.0 and spec["speedup_vs_plain"] > 0
    assert "| eagle num_iter=2 |" in r.stdout and "1/1 |" in r.stdout


@pytest.mark.smollm2
def test_chat_and_text_records_train_the_answer(smollm2_tokenizer, tmp_path):
    from minicpm_jax.train.data import read_examples

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello there!"}]}) + "\n"
                    + json.dumps({"text": "Plain text is trained everywhere."}) + "\n")
    chat, text = read_examples(str(path), smollm2_tokenizer, 49152)
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                   tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert chat.ids[: len(prompt)] == prompt and chat.start == len(prompt) - 1
    assert smollm2_tokenizer.decode(chat.ids[len(prompt):]).startswith("Hello there!")
    assert text.start == 0
    assert smollm2_tokenizer.decode(text.ids, skip_special_tokens=True) == "Plain text is trained everywhere."
