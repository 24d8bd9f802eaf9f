"""MiniCPM4 directories laid out as they are published, run end to end by ``python -m minicpm_jax.run``
with stdin closed and ``--json_output`` (stdout must be the JSON alone): dense, InfLLM-v2 with
``dense_len -1`` and ``--minicpm4_yarn``, int4 through quantize → marlin-cpmcu, and EAGLE drafts in CPM.cu's,
vLLM's (with ``model.norm``) and EAGLE-3 ``layers.0`` layouts, whose greedy speculative text must equal the
plain greedy text.

The checkpoint is MiniCPM4-8B's config.json (architectures, ``auto_map``, ``mup_denominator``, LongRoPE
with head_dim 128, ``sparse_config``, eos ``[2, 73440]``, untied head, vocabulary 73448) with the widths
and depth shrunk, random bf16 weights, and the demo model's tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from checkpoints_convert.__main__ import main as convert_main
from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.loading import save_draft
from tests import helpers

pytestmark = pytest.mark.smollm2
PROMPT = "Write one sentence about the sea."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def minicpm4_8b_shrunk() -> dict:
    rng = np.random.default_rng(8)
    return {
        "architectures": ["MiniCPMForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                     "AutoModel": "modeling_minicpm.MiniCPMModel",
                     "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"},
        "bos_token_id": 1, "eos_token_id": [2, 73440], "pad_token_id": 2, "hidden_act": "silu",
        "initializer_range": 0.1, "model_type": "minicpm", "mup_denominator": 32, "rms_norm_eps": 1e-06,
        "max_position_embeddings": 32768, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "use_cache": True,
        "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 32768,
                         "long_factor": [float(x) for x in 1 + 2 * rng.random(64)],
                         "short_factor": [float(x) for x in 1 + 2 * rng.random(64)]},
        "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4, "tie_word_embeddings": False,
        "sparse_config": {"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64,
                          "window_size": 2048, "topk": 64, "use_nope": False, "dense_len": 8192},
        "vocab_size": 73448,
        # shrunk from 4096 / 16384 / 32 layers / 32 heads / 2 KV heads; head_dim stays 128
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 128,
    }


@pytest.fixture(scope="module")
def published(smollm2_dir, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("published")
    cfg = minicpm4_8b_shrunk()
    weights = helpers.random_hf_weights(cfg, seed=1, std=0.05)
    path = str(root / "MiniCPM4-8B")
    os.makedirs(path)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 73440], "do_sample": True, "temperature": 0.8}, f)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2_dir, name)):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    return path


def _run(*args: str) -> dict:
    """The run CLI with stdin closed; its stdout must parse as one JSON object."""
    r = subprocess.run([sys.executable, "-m", "minicpm_jax.run", "--prompt_text", PROMPT, "--num_generate", "10",
                        "--ignore_eos", "--dtype", "float32", "--json_output", *args],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900, env=os.environ)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "[y/N]" not in r.stdout + r.stderr
    return json.loads(r.stdout)  # nothing else on stdout


@pytest.fixture(scope="module")
def plain(published) -> dict:
    return _run("--model_path", published, "--max_length", "512")


def test_dense(plain, published):
    assert plain["completion_tokens"] == 10 and plain["sparse"].endswith("inactive: max_length 512 < dense_len")
    assert plain["weights"] == "dense" and plain["model_path"] == published


def test_always_sparse_with_minicpm4_yarn(published):
    """dense_len -1 as MiniCPM's README writes it; a narrowed window and top-k so a 300-token prompt
    selects blocks."""
    out = _run("--model_path", published, "--max_length", "512", "--dense_len", "-1", "--sparse_window", "64",
               "--sparse_topk", "1", "--minicpm4_yarn", "--prompt_text", " ".join(["tide"] * 300))
    assert out["sparse"] == "topk 1 + window 64 (2 blocks of 64) always"
    assert out["completion_tokens"] == 10 and out["prompt_tokens"] > 300


def test_int4_quantize_then_marlin(published, tmp_path):
    gptq, marlin = str(tmp_path / "gptq"), str(tmp_path / "MiniCPM4-8B-marlin-cpmcu")
    assert convert_main(["quantize", "--src", published, "--dst", gptq, "--method", "rtn", "--group_size", "128"]) == 0
    assert convert_main(["gptq", "--src", gptq, "--dst", marlin, "--layout", "marlin"]) == 0
    out = _run("--model_path", marlin, "--max_length", "512")
    assert out["weights"].startswith("int4 g128 sym") and out["completion_tokens"] == 10


def _eagle(published: str, kind: str, dst: str) -> str:
    cfg = ModelConfig.from_pretrained(published)
    draft = EagleDraft(DraftSpec.for_target(cfg, kind, draft_vocab=4096 if kind == "eagle3" else None),
                       max_length=512, attention_impl="xla", rngs=nnx.Rngs(3))
    if kind == "eagle3":  # a draft vocabulary of the 4096 lowest ids: d2t = 0
        draft.d2t[...] = jnp.zeros_like(draft.d2t[...])
    save_draft(draft, dst)
    return dst


def _rename(src: str, dst: str, rename, extra: dict | None = None) -> str:
    tensors = {rename(k): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    os.makedirs(dst)
    save_file({**tensors, **(extra or {})}, os.path.join(dst, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), dst)
    return dst


@pytest.mark.parametrize("layout", ["cpmcu", "vllm_with_norm", "eagle3_layers0"])
def test_speculative_greedy_equals_plain_greedy(published, plain, layout, tmp_path):
    if layout == "cpmcu":
        draft = _eagle(published, "minicpm", str(tmp_path / "MiniCPM4-8B-Eagle-FRSpec"))
    elif layout == "vllm_with_norm":
        cpmcu = _eagle(published, "minicpm", str(tmp_path / "cpmcu"))
        vllm = str(tmp_path / "vllm")
        assert convert_main(["eagle", "--src", cpmcu, "--dst", vllm, "--layout", "vllm", "--target", published]) == 0
        names = load_file(os.path.join(vllm, "model.safetensors"))
        if "model.norm.weight" not in names:  # the vLLM MiniCPM EAGLE weights list model.norm
            names["model.norm.weight"] = np.ones(128, np.float32)
            save_file(names, os.path.join(vllm, "model.safetensors"))
        draft = vllm
    else:
        midlayer = _eagle(published, "eagle3", str(tmp_path / "midlayer"))
        draft = _rename(midlayer, str(tmp_path / "MiniCPM4.1-8B-Eagle3"), lambda k: k.replace("midlayer.", "layers.0."))
    out = _run("--model_path", published, "--max_length", "512", "--draft_path", draft)
    assert out["text"] == plain["text"] and out["token_ids"] == plain["token_ids"]
    assert out["stats"]["spec_rounds"] >= 1
