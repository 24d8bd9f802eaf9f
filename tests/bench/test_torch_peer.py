"""The gpt-fast-style PyTorch peer (``benchmarks/torch_peer.py``, ``--peer torch``): its decoder gives
transformers' ``LlamaForCausalLM`` logits on the same weights (prompt, then one-token steps through its
static cache), its tinygemm int4 linear equals the dequantized weights' product, and its command prints
the rows the benchmark reads (CPU; the GPU runs the same code with CUDA graphs)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from benchmarks import torch_peer  # noqa: E402
from benchmarks.hf_peer import hf_llama_config  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from minicpm_jax.config import ModelConfig  # noqa: E402


def test_decoder_equals_transformers_llama_through_its_static_cache():
    from transformers import LlamaForCausalLM

    shape = SHAPES["minicpm4-tiny"]
    torch.manual_seed(1)
    hf = LlamaForCausalLM(hf_llama_config(shape)).float().eval()
    ours = torch_peer.Decoder(ModelConfig.from_dict(shape), 1, 32).float().eval()
    ours.load_hf_state(hf.state_dict())
    ids = torch.randint(0, shape["vocab_size"], (1, 12))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids[:, :9], torch.arange(9))  # a prompt of 9, then three one-token steps
        steps = [ours(ids[:, i : i + 1], torch.tensor([i])) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat([got] + steps, dim=1), want, rtol=1e-4, atol=1e-4)
    assert torch_peer.decode_one(ours, ids[:, 11:12], torch.tensor([11])).item() == want[0, -1].argmax().item()


def test_int4_linear_equals_the_dequantized_weights():
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    q, scales, zeros = torch_peer.quantize_int4(w, 128)
    assert q.min() >= 0 and q.max() <= 15 and q.dtype == torch.int32
    dequant = ((q.reshape(64, 2, 128) - 8) * scales[..., None] + zeros[..., None]).reshape(64, 256)
    assert (dequant - w).abs().max() <= (scales.max() / 2) * 1.001  # round to nearest: half a step at most
    x = torch.randn(3, 256)
    torch.testing.assert_close(torch_peer.Int4Linear(w, 128)(x), x @ dequant.T, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="int4 needs"):
        torch_peer.Int4Linear(torch.randn(64, 96), 32)


def test_command_prints_rows_for_both_weight_formats(capsys):
    out = torch_peer.main(["--shape", "minicpm4-tiny", "--contexts", "16,32", "--decode_steps", "3", "--repeats", "1",
                           "--device", "cpu", "--compile", "none"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert [(r["quant"], r["context"]) for r in out["rows"]] == [("none", 16), ("none", 32), ("int4", 16), ("int4", 32)]
    for r in out["rows"]:
        assert r["error"] is None and len(r["decode_ms_per_token"]) == 1 and r["prefill_tok_s"][0] > 0
    assert out["copy_bandwidth_Bps"] > 0 and out["matmul_flops"] > 0


def test_rooflines_only_measures_the_ceilings_and_no_rows(capsys):
    """``--rooflines_only`` (what ``python -m benchmarks`` runs on a GPU for the faster roofline): PyTorch's
    copy bandwidth and matmul FLOP/s, and no decoder rows."""
    out = torch_peer.main(["--rooflines_only", "--device", "cpu"])
    assert out["rows"] == [] and out["copy_bandwidth_Bps"] > 0 and out["matmul_flops"] > 0


def test_linears_time_tinygemm_on_every_decoder_linear(capsys):
    """``--linears_ms`` (the int4 scenario's peer): tinygemm on each decoder linear shape at each row count,
    instead of the decoder rows; a bad row list is refused."""
    from benchmarks.shapes import linear_shapes

    out = torch_peer.main(["--shape", "minicpm4-tiny", "--linears_ms", "1,3", "--group_size", "64", "--repeats", "1",
                           "--device", "cpu"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out and out["rows"] == []
    shapes = linear_shapes(ModelConfig.from_dict(SHAPES["minicpm4-tiny"]))
    assert [(r["name"], r["m"]) for r in out["linears"]] == [(n, m) for n in shapes for m in (1, 3)]
    for r in out["linears"]:
        assert (r["k"], r["n"]) == shapes[r["name"]] and r["group_size"] == 64
        assert len(r["seconds"]) == 1 and r["seconds"][0] > 0
    # SmolLM2's 576-wide inputs do not fit tinygemm's packing (K a multiple of 128): those rows carry the error
    rows = torch_peer.bench_linears(SHAPES["smollm2-135m"], [1], 64, 1, "cpu")
    assert [(r["name"], isinstance(r["seconds"], str)) for r in rows] == [
        ("qkv", True), ("o", True), ("gate_up", True), ("down", False)]
    assert "int4 needs K a multiple of 64 and 128" in rows[0]["seconds"] and rows[3]["seconds"][0] > 0
    with pytest.raises(SystemExit):
        torch_peer.main(["--linears_ms", "1,x", "--device", "cpu"])
    assert "--linears_ms takes row counts" in capsys.readouterr().err
