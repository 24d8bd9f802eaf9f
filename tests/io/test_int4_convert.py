"""int4 converters and the quantized SmolLM2: ``checkpoints_convert quantize`` (RTN, GPTQ) and ``gptq``
(native, marlin-cpmcu), perplexity against transformers and against the dense model, the run CLI with
``--quant``, and bad input."""

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open

from checkpoints_convert.__main__ import main as convert_main
from minicpm_jax.cli.perplexity import negative_log_likelihood, perplexity
from minicpm_jax.io import int4_formats as int4
from minicpm_jax.io.native import is_native
from minicpm_jax.model.loading import load_model
from tests import helpers

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
EVAL_TEXT = os.path.join(DATA, "eval_text.txt")
CALIBRATION_TEXT = os.path.join(DATA, "calibration_text.txt")
CONTEXT = 1024  # eval windows (the text is ~1.9K tokens: two windows)
GROUP = 64  # SmolLM2's hidden size 576 is not a multiple of 128


def _convert(*args):
    assert convert_main([str(a) for a in args]) == 0


def _logits(model, ids):
    cache = model.new_cache(1)
    return np.asarray(model(jnp.asarray([ids], jnp.int32), cache)[0][0])


def _load(path, **kw):
    return load_model(path, dtype=jnp.float32, attention_impl="xla", max_length=CONTEXT, **kw)


@pytest.fixture(scope="module")
def eval_ids(smollm2_tokenizer):
    with open(EVAL_TEXT, encoding="utf-8") as f:
        return smollm2_tokenizer(f.read(), add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def rtn_dir(smollm2_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("int4") / "rtn"
    _convert("quantize", "--src", smollm2_dir, "--dst", dst, "--method", "rtn", "--group_size", GROUP)
    return str(dst)


@pytest.fixture(scope="module")
def gptq_dir(smollm2_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("int4") / "gptq"
    _convert("quantize", "--src", smollm2_dir, "--dst", dst, "--method", "gptq", "--group_size", GROUP,
             "--calibration_file", CALIBRATION_TEXT, "--seq_length", 512, "--num_samples", 12, "--desc_act")
    return str(dst)


@pytest.fixture(scope="module")
def dense_nll(smollm2_dir, eval_ids):
    """(total, count) of the dense model over the eval windows, in 256-token chunks: checked against
    transformers below, and the dense perplexity of the quality test (one dense pass for both)."""
    return negative_log_likelihood(_load(smollm2_dir), eval_ids, context=CONTEXT, chunk_length=256)


@pytest.fixture(scope="module")
def perplexities(dense_nll, rtn_dir, gptq_dir, eval_ids):
    total, count = dense_nll
    return {"dense": math.exp(total / count),
            **{name: perplexity(_load(path), eval_ids, context=CONTEXT) for name, path in (("rtn", rtn_dir),
                                                                                          ("gptq", gptq_dir))}}


@pytest.mark.smollm2
def test_perplexity_matches_transformers(dense_nll, hf_smollm2, eval_ids):
    """Our NLL over the eval windows equals transformers' on the same GGUF weights (the ppl oracle)."""
    total, count = dense_nll
    ref_total, ref_count = 0.0, 0
    for start in range(0, len(eval_ids) - 1, CONTEXT):
        window = torch.tensor([eval_ids[start : start + CONTEXT]])
        with torch.no_grad():
            logp = torch.log_softmax(hf_smollm2(window).logits[0].double(), -1)
        ref_total -= logp[:-1].gather(1, window[0, 1:, None]).sum().item()
        ref_count += window.shape[1] - 1
    assert count == ref_count == len(eval_ids) - math.ceil(len(eval_ids) / CONTEXT)
    assert abs(total - ref_total) / ref_total < 1e-4


@pytest.mark.smollm2
def test_quantized_perplexity(perplexities):
    """Symmetric int4, group 64, on a fixed held-out text. Measured on the 2-core CPU (BENCHMARKS.md):
    dense 25.05, RTN 34.96 (+39.6%), GPTQ with act-order and asymmetric calibration 29.53 (+17.9%, jitted
    layer forwards; 29.22-29.28 eager, the solver is that sensitive to rounding; classic GPTQ 30.92, +23.4%). The bounds are those numbers plus a margin (regression guards); the issue's targets
    (+15% / +8%) are not reached on this model (asymmetric codes: GPTQ 27.91, +11.4%)."""
    dense, rtn, gptq = perplexities["dense"], perplexities["rtn"], perplexities["gptq"]
    print(f"perplexity dense {dense:.3f}, rtn {rtn:.3f} ({rtn / dense - 1:+.1%}), gptq {gptq:.3f} ({gptq / dense - 1:+.1%})")
    assert 20 < dense < 30
    assert gptq < 0.88 * rtn  # GPTQ's error feedback and calibration are worth > 12% perplexity here
    assert rtn / dense < 1.45 and gptq / dense < 1.20


@pytest.mark.smollm2
def test_gptq_output_is_a_standard_gptq_checkpoint(gptq_dir, smollm2_dir):
    with open(os.path.join(gptq_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == GROUP and qc["sym"] is True
    assert qc["desc_act"] is True and qc["checkpoint_format"] == "gptq"
    for side in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(gptq_dir, side))
    with safe_open(os.path.join(gptq_dir, "model.safetensors"), "np") as f:
        names = set(f.keys())
        pre = "model.layers.3.self_attn.k_proj."
        qweight, qzeros, scales, g_idx = (f.get_tensor(pre + s) for s in ("qweight", "qzeros", "scales", "g_idx"))
        dense_names = {n for n in names if not n.endswith(("qweight", "qzeros", "scales", "g_idx"))}
    assert qweight.dtype == np.int32 and qweight.shape == (576 // 8, 192)
    assert qzeros.shape == (576 // GROUP, 192 // 8) and scales.dtype == np.float16 and scales.shape == (9, 192)
    # act-order: rows are assigned to groups in order of decreasing Hessian diagonal, 64 rows per group
    assert sorted(np.bincount(g_idx).tolist()) == [GROUP] * 9 and not np.array_equal(g_idx, np.arange(576) // GROUP)
    assert np.all(int4.unpack_cols(qzeros) == 7)  # v1 stores the symmetric zero point 8 minus one
    assert "model.embed_tokens.weight" in dense_names and not any("proj" in n for n in dense_names)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)  # split names, as AutoGPTQ writes


@pytest.mark.smollm2
def test_rtn_converter_equals_rtn_at_load(rtn_dir, smollm2_dir, eval_ids):
    """Same codes; the checkpoint's scales are float16 (GPTQ's dtype), the load-time ones float32."""
    ids = eval_ids[:48]
    a, b = _load(rtn_dir), _load(smollm2_dir, quant="int4", group_size=GROUP)
    for la, lb in zip(a.model.layers, b.model.layers):
        for lin_a, lin_b in ((la.self_attn.qkv_proj, lb.self_attn.qkv_proj), (la.mlp.down_proj, lb.mlp.down_proj)):
            np.testing.assert_array_equal(np.asarray(lin_a.qweight[...]), np.asarray(lin_b.qweight[...]))
            np.testing.assert_allclose(np.asarray(lin_a.scales[...]), np.asarray(lin_b.scales[...]), rtol=1e-3)
    assert helpers.rel_err(_logits(a, ids), _logits(b, ids)) < 5e-3


@pytest.mark.smollm2
def test_marlin_and_native_round_trips_keep_logits(rtn_dir, gptq_dir, tmp_path, capsys, eval_ids):
    """quantize → gptq --layout marlin (symmetric, no act-order: the RTN checkpoint) and → native (both)."""
    ids = eval_ids[:48]
    marlin = tmp_path / "marlin"
    _convert("gptq", "--src", rtn_dir, "--dst", marlin, "--layout", "marlin")
    assert "CPM.cu only runs group 128" in capsys.readouterr().err
    assert "model_gptq.safetensors" in os.listdir(marlin)
    with safe_open(os.path.join(marlin, "model_gptq.safetensors"), "np") as f:
        qkv = f.get_tensor("model.layers.0.self_attn.qkv_proj.qweight")
        assert qkv.shape == (576 // 16, 2 * (576 + 2 * 192))  # fused, Marlin-packed
        assert "model.layers.0.self_attn.q_proj.qweight" not in set(f.keys())
    model = _load(str(marlin))
    assert model.quant is not None and model.quant.group_size == GROUP
    np.testing.assert_array_equal(_logits(model, ids), _logits(_load(rtn_dir), ids))
    assert "act-order" in _fails(capsys, "gptq", "--src", gptq_dir, "--dst", tmp_path / "m2", "--layout", "marlin")
    native = tmp_path / "native"
    _convert("gptq", "--src", gptq_dir, "--dst", native)
    model = _load(str(native))
    assert is_native(str(native)) and model.quant.act_order
    np.testing.assert_array_equal(_logits(model, ids), _logits(_load(gptq_dir), ids))


@pytest.mark.smollm2
def test_quantized_model_generates(gptq_dir):
    r = subprocess.run([sys.executable, "-m", "minicpm_jax.run", "--model_path", gptq_dir, "--prompt_text",
                        "What is the capital of France?", "--num_generate", "16", "--json_output", "--seed", "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["completion_tokens"] >= 4


@pytest.mark.smollm2
def test_perplexity_cli_and_quant_flags(smollm2_2_layers_dir, smollm2_tokenizer, tmp_path):
    """The CLI's number is the library's, and its --quant flags: on the eval text's first three paragraphs
    (~360 tokens) with a 256-token context, so still two windows, the second one partial, as the whole text
    has with the 1024-token context of the quality test (which the three runs need not repeat). On the demo
    model cut to two layers, RTN-quantized here: the claim is the CLI's plumbing, which every layer shares."""
    smollm2_dir, rtn_dir = smollm2_2_layers_dir, str(tmp_path / "rtn")
    _convert("quantize", "--src", smollm2_dir, "--dst", rtn_dir, "--method", "rtn", "--group_size", GROUP)
    with open(EVAL_TEXT, encoding="utf-8") as f:
        text = "\n\n".join(f.read().split("\n\n")[:3])
    short = tmp_path / "eval_short.txt"
    short.write_text(text, encoding="utf-8")
    ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    context = 256
    assert context < len(ids) - 1 < 2 * context
    rtn = perplexity(load_model(rtn_dir, dtype=jnp.float32, attention_impl="xla", max_length=context), ids,
                     context=context)

    def ppl(*args):
        r = subprocess.run([sys.executable, "-m", "minicpm_jax.perplexity", "--text_file", str(short),
                            "--max_length", str(context), "--dtype", "float32", *args],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        assert f"over {len(ids) - 2} tokens (context {context}," in r.stdout  # two windows scored
        return float(r.stdout.split()[1])

    assert ppl("--model_path", rtn_dir) == pytest.approx(rtn, rel=1e-4)
    # --quant int4 on the dense checkpoint is the same RTN; --quant none dequantizes the int4 one
    assert ppl("--model_path", smollm2_dir, "--quant", "int4", "--quant_group_size", str(GROUP)) == pytest.approx(
        rtn, rel=1e-3)
    assert ppl("--model_path", rtn_dir, "--quant", "none") == pytest.approx(rtn, rel=1e-3)


# ------------------------------------------------------------------------------------------ bad input
def _fails(capsys, *args) -> str:
    assert convert_main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_converter_bad_input(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt[0]
    assert "needs --calibration_file" in _fails(capsys, "quantize", "--src", src, "--dst", tmp_path / "a")
    assert "does not divide this model's linear widths (64, 96, 128); sizes that fit: 32, 16 or -1" in _fails(
        capsys, "quantize", "--src", src, "--dst", tmp_path / "a", "--method", "rtn", "--group_size", "128")
    assert "multiple of 16" in _fails(capsys, "quantize", "--src", src, "--dst", tmp_path / "a", "--method", "rtn",
                                      "--group_size", "24")
    assert "only applies to --method gptq" in _fails(capsys, "quantize", "--src", src, "--dst", tmp_path / "a",
                                                     "--method", "rtn", "--desc_act")
    assert "not a GPTQ" in _fails(capsys, "gptq", "--src", src, "--dst", tmp_path / "b")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")

    assert "--asym needs --checkpoint_format gptq_v2" in _fails(
        capsys, "quantize", "--src", src, "--dst", tmp_path / "e", "--method", "rtn", "--asym", "--checkpoint_format",
        "gptq")  # refused before any work (v1 cannot store a zero point of 0)
    assert not os.path.exists(tmp_path / "e")
    asym = tmp_path / "asym"
    capsys.readouterr()
    _convert("quantize", "--src", src, "--dst", asym, "--method", "rtn", "--asym")  # default group size: 128 ...
    assert "quantizing with group size 32" in capsys.readouterr().err  # ... does not fit: the largest that does
    with open(asym / "config.json") as f:  # --checkpoint_format auto: v2 for asymmetric codes
        config = json.load(f)["quantization_config"]
    assert config["checkpoint_format"] == "gptq_v2" and config["group_size"] == 32
    assert "already quantized" in _fails(capsys, "quantize", "--src", asym, "--dst", tmp_path / "c", "--method", "rtn")
    assert "sym=true" in _fails(capsys, "gptq", "--src", asym, "--dst", tmp_path / "c", "--layout", "marlin")
    assert "already exists" in _fails(capsys, "quantize", "--src", src, "--dst", asym, "--method", "rtn")
    assert "--calibration_file" in _fails(capsys, "quantize", "--src", src, "--dst", tmp_path / "d",
                                          "--calibration_file", tmp_path / "missing.txt")


def test_asym_rtn_checkpoint_round_trips_through_native(tiny_ckpt, tmp_path):
    """Asymmetric RTN of the tiny MiniCPM4: the GPTQ checkpoint, its native conversion and load-time RTN agree."""
    src = tiny_ckpt[0]
    ids = list(range(3, 40))
    _convert("quantize", "--src", src, "--dst", tmp_path / "q", "--method", "rtn", "--group_size", "32", "--asym",
             "--checkpoint_format", "gptq_v2")
    _convert("gptq", "--src", tmp_path / "q", "--dst", tmp_path / "n")
    a = _logits(load_model(tmp_path / "q", dtype=jnp.float32, max_length=64), ids)
    b = _logits(load_model(tmp_path / "n", dtype=jnp.float32, max_length=64), ids)
    np.testing.assert_array_equal(a, b)
    dense = _logits(load_model(src, dtype=jnp.float32, max_length=64), ids)
    assert 1e-4 < helpers.rel_err(a, dense) < 0.2  # quantized, and still the same model
    from checkpoints_convert.inspect_checkpoint import inspect

    gptq, native = inspect(str(tmp_path / "q")), inspect(str(tmp_path / "n"))
    assert gptq["int4"] == {"group_size": 32, "sym": False, "act_order": False, "stored": "gptq_v2"}
    assert native["int4"]["stored"] == "native" and native["format"] == "native"
    assert gptq["parameters"] == native["parameters"] == inspect(src)["parameters"]  # weights, not packed words
