"""int4 checkpoints end to end: synthetic GPTQ / marlin-cpmcu checkpoints written on disk the way the real
tools write them, loaded with ``load_model`` and run.

The oracle of every int4 model is a *dense* checkpoint whose HF weights are the dequantized matrices
(``Int4Weight.dequantize().T``, computed here from the codes, scales and zero points the test chose), run
by the dense model path; so each check covers the on-disk tensor names, packing, zero-point convention,
act-order folding, fusion and the int4 matmul together.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from minicpm_jax.io import int4_formats as int4
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.loading import load_model, save_native
from tests import helpers

CFG = helpers.tiny_minicpm_config()
MAX_LENGTH = 64
IDS = np.random.default_rng(7).integers(0, CFG["vocab_size"], 11)
# (module, checkpoint linears sharing one input, fused name or None)
GROUPS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("self_attn", ("o_proj",), None),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
    ("mlp", ("down_proj",), None),
)


# ------------------------------------------------------------------------------------ checkpoint builders
def _num_layers(named: dict) -> int:
    return 1 + max(int(k.split(".")[2]) for k in named if k.startswith("model.layers."))


def _quantize_rows(w: np.ndarray, g_idx: np.ndarray, gs: int, sym: bool) -> int4.Int4Weight:
    """Round-to-nearest of ``w [K, N]`` where group g is the rows with ``g_idx == g`` (in any order);
    scales rounded to fp16 (what a GPTQ checkpoint stores), so the Int4Weight is exactly what is written."""
    k, n = w.shape
    groups = k // gs
    q = np.zeros((k, n), np.uint8)
    scales = np.zeros((groups, n), np.float32)
    zeros = None if sym else np.zeros((groups, n), np.float32)
    for g in range(groups):
        rows = np.flatnonzero(g_idx == g)
        r = int4.rtn_quantize(w[rows], group_size=-1, sym=sym)
        q[rows], scales[g] = r.q, r.scales[0]
        if not sym:
            zeros[g] = r.zeros[0]
    scales = scales.astype(np.float16).astype(np.float32)
    return int4.Int4Weight(q, scales, zeros, g_idx.astype(np.int32), gs)


def quantize_linears(weights, *, gs: int, sym: bool, act_order: bool = False, seed: int = 0) -> dict[str, int4.Int4Weight]:
    """``{checkpoint prefix: Int4Weight}`` of every decoder linear. With act_order each input gets one
    shuffled ``g_idx`` shared by the linears reading it (q/k/v, gate/up), as GPTQ's desc_act produces."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(_num_layers(weights)):
        for module, names, _ in GROUPS:
            pre = f"model.layers.{layer}.{module}."
            k = weights[pre + names[0] + ".weight"].shape[1]
            g = k if gs == -1 else gs
            g_idx = np.arange(k) // g
            if act_order:
                g_idx = rng.permutation(g_idx)
                assert not np.array_equal(g_idx, np.arange(k) // g)
            for name in names:
                out[pre + name] = _quantize_rows(weights[pre + name + ".weight"].T, g_idx, g, sym)
    return out


def fuse(qlin: dict[str, int4.Int4Weight]) -> dict[str, int4.Int4Weight]:
    """q/k/v → ``qkv_proj`` and gate/up → ``gate_up_proj`` (as CPM.cu and some exporters store them)."""
    out = {}
    for layer in range(_num_layers(qlin)):
        for module, names, fused in GROUPS:
            pre = f"model.layers.{layer}.{module}."
            if fused is None:
                out[pre + names[0]] = qlin[pre + names[0]]
            else:
                out[pre + fused] = int4.concat_columns([qlin[pre + n] for n in names])
    return out


def _dense_rest(weights) -> dict[str, np.ndarray]:
    """Embeddings, norms and lm_head (kept dense in every int4 checkpoint)."""
    return {k: v for k, v in weights.items() if not k.endswith("_proj.weight")}


def dequantized_weights(weights, qlin) -> dict[str, np.ndarray]:
    """HF weights with every decoder linear replaced by its dequantized matrix (the oracle)."""
    out = dict(weights)
    for prefix, w in qlin.items():
        out[prefix + ".weight"] = np.ascontiguousarray(w.dequantize().T.astype(np.float32))
    return out


def gptq_tensors(weights, qlin, fmt: str) -> dict[str, np.ndarray]:
    out = _dense_rest(weights)
    for prefix, w in qlin.items():
        if fmt == "gptq" and w.zeros is not None:
            assert w.zeros.min() >= 1, "v1 cannot store zero point 0 (test data must avoid it)"
        for suffix, value in int4.gptq_pack(w, fmt).items():
            out[f"{prefix}.{suffix}"] = value
    return out


def marlin_tensors(weights, qlin) -> dict[str, np.ndarray]:
    """CPM.cu's gptq2marlin output: fused linears, Marlin ``qweight [K/16, 2N]``, permuted fp16 scales.
    As in CPM.cu / vLLM / IST-DASLab marlin, a linear with one scale group (group_size -1 or >= K) gets
    the per-channel ``scale_perm_single`` shuffle, every other linear the grouped 8x8 transpose."""
    out = _dense_rest(weights)
    for prefix, w in fuse(qlin).items():
        assert w.zeros is None and w.trivial_g_idx
        per_channel = w.scales.shape[0] == 1
        out[prefix + ".qweight"] = int4.marlin_pack(w.q)
        out[prefix + ".scales"] = int4.marlin_permute_scales(w.scales, per_channel=per_channel).astype(np.float16)
    return out


def qconfig(gs: int, sym: bool, act: bool = False, fmt: str = "gptq", **extra) -> dict:
    return dict({"quant_method": "gptq", "bits": 4, "group_size": gs, "sym": sym, "desc_act": act,
                 "checkpoint_format": fmt}, **extra)


def write(path, tensors, quantization_config=None, cfg=CFG, filename="model.safetensors") -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    raw = dict(cfg)
    if quantization_config is not None:
        raw["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    # safetensors.numpy writes raw memory: arrays must be C-contiguous (torch.save_file makes them so)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, filename))
    return path


# ------------------------------------------------------------------------------------------ running
def run_logits(model) -> np.ndarray:
    cache = model.new_cache(1, MAX_LENGTH)
    logits, _, _ = model(jnp.asarray([IDS], jnp.int32), cache)
    return np.asarray(logits[0], np.float32)


def load(path, **kwargs):
    kwargs = {"dtype": jnp.float32, "max_length": MAX_LENGTH, "attention_impl": "xla", **kwargs}
    return load_model(path, **kwargs)


def params(model) -> dict[tuple, np.ndarray]:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def is_int4(model) -> bool:
    return any(p[-1] == "qweight" for p in params(model))


def dense_logits(tmp_path, weights, qlin, cfg=CFG) -> np.ndarray:
    return run_logits(load(helpers.write_checkpoint(str(tmp_path / "dense"), cfg, dequantized_weights(weights, qlin))))


@pytest.fixture(scope="module")
def weights():
    return helpers.random_hf_weights(CFG, seed=11)


@pytest.fixture(scope="module")
def sym32(weights, tmp_path_factory):
    """A symmetric group-32 GPTQ v1 checkpoint, its Int4Weights and the oracle logits."""
    qlin = quantize_linears(weights, gs=32, sym=True)
    root = tmp_path_factory.mktemp("sym32")
    path = write(root / "gptq", gptq_tensors(weights, qlin, "gptq"), qconfig(32, True))
    return path, qlin, dense_logits(root, weights, qlin)


# -------------------------------------------------------------------------------------------- 1. GPTQ
@pytest.mark.parametrize(
    "fmt, sym, act, gs",
    [("gptq", True, False, 32), ("gptq_v2", False, False, 16), ("gptq", False, True, 32), ("gptq", True, False, -1)],
    ids=["v1-sym-g32", "v2-asym-g16", "v1-asym-actorder-g32", "v1-sym-perchannel"],
)
def test_gptq_checkpoint_matches_dequantized_dense_model(weights, tmp_path, fmt, sym, act, gs):
    qlin = quantize_linears(weights, gs=gs, sym=sym, act_order=act, seed=3)
    path = write(tmp_path / "gptq", gptq_tensors(weights, qlin, fmt), qconfig(gs, sym, act, fmt))
    model = load(path)
    assert model.quant is not None and is_int4(model)
    assert (model.quant.group_size, model.quant.sym, model.quant.act_order) == (gs, sym, act)
    p = params(model)
    assert p[("model", "layers", 0, "self_attn", "qkv_proj", "qweight")].dtype == np.int32
    assert (("model", "layers", 0, "mlp", "down_proj", "zeros") in p) == (not sym)
    assert (("model", "layers", 0, "mlp", "down_proj", "perm") in p) == act
    ours = run_logits(model)
    ref = dense_logits(tmp_path, weights, qlin)
    assert helpers.rel_err(ours, ref) < 1e-5
    # The quantization is visible: the original (unquantized) weights give different logits.
    orig = run_logits(load(helpers.write_checkpoint(str(tmp_path / "orig"), CFG, weights)))
    assert helpers.rel_err(orig, ref) > 1e-3


def test_zero_point_convention_matters(weights, tmp_path):
    """A v2 (true zero points) checkpoint labelled v1 is read with zeros off by one: different logits.
    Guards the v1/v2 cases above against a loader that ignores checkpoint_format."""
    qlin = quantize_linears(weights, gs=32, sym=False, seed=4)
    tensors = gptq_tensors(weights, qlin, "gptq_v2")
    good = run_logits(load(write(tmp_path / "v2", tensors, qconfig(32, False, fmt="gptq_v2"))))
    bad = run_logits(load(write(tmp_path / "v1", tensors, qconfig(32, False, fmt="gptq"))))
    assert helpers.rel_err(good, dense_logits(tmp_path, weights, qlin)) < 1e-5
    assert helpers.rel_err(bad, good) > 1e-3


def test_sharded_gptq_checkpoint(weights, sym32, tmp_path):
    """qweight / scales / qzeros of one linear spread over shards (model.safetensors.index.json)."""
    path, qlin, ref = sym32
    tensors = {k: np.ascontiguousarray(v) for k, v in gptq_tensors(weights, qlin, "gptq").items()}
    sharded = helpers.write_checkpoint(str(tmp_path / "sharded"), dict(CFG, quantization_config=qconfig(32, True)),
                                       tensors, shards=3)
    assert helpers.rel_err(run_logits(load(sharded)), ref) < 1e-5


def test_desc_act_true_without_g_idx_tensors(weights, sym32, tmp_path):
    """desc_act=true with no g_idx stored (optional tensor): rows in natural group order."""
    _, qlin, ref = sym32
    tensors = {k: v for k, v in gptq_tensors(weights, qlin, "gptq").items() if not k.endswith(".g_idx")}
    model = load(write(tmp_path / "c", tensors, qconfig(32, True, act=True)))
    assert model.quant.act_order
    perm = params(model)[("model", "layers", 0, "self_attn", "qkv_proj", "perm")]
    np.testing.assert_array_equal(perm, np.arange(64))
    assert helpers.rel_err(run_logits(model), ref) < 1e-5


def test_bfloat16_int4_model(weights, tmp_path):
    """A bf16 model keeps int4 scales / zeros in float16 (GPTQ's own dtype) and is close to fp32."""
    qlin = quantize_linears(weights, gs=32, sym=False, act_order=True, seed=16)
    path = write(tmp_path / "gptq", gptq_tensors(weights, qlin, "gptq"), qconfig(32, False, True))
    model = load(path, dtype=jnp.bfloat16)
    p = params(model)
    lin = ("model", "layers", 0, "mlp", "gate_up_proj")
    assert p[lin + ("qweight",)].dtype == np.int32 and p[lin + ("perm",)].dtype == np.int32
    assert p[lin + ("scales",)].dtype == np.float16 and p[lin + ("zeros",)].dtype == np.float16
    assert p[("model", "embed_tokens", "embedding")].dtype == jnp.bfloat16
    assert helpers.rel_err(run_logits(model), run_logits(load(path))) < 3e-2


def test_old_autogptq_quantize_config_json(weights, sym32, tmp_path):
    """AutoGPTQ before transformers integration: no quantization_config, a quantize_config.json beside it."""
    path, qlin, ref = sym32
    old = write(tmp_path / "old", gptq_tensors(weights, qlin, "gptq"))
    with open(os.path.join(old, "quantize_config.json"), "w") as f:
        json.dump({"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
                   "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": None}, f)
    model = load(old)
    assert model.quant is not None and model.quant.group_size == 32
    assert helpers.rel_err(run_logits(model), ref) < 1e-5


# ----------------------------------------------------------------------------------------- 2. fused names
@pytest.mark.parametrize("act", [False, True], ids=["sym-g32", "asym-actorder"])
def test_fused_gptq_names_equal_split(weights, tmp_path, act):
    qlin = quantize_linears(weights, gs=32, sym=not act, act_order=act, seed=5)
    split = write(tmp_path / "split", gptq_tensors(weights, qlin, "gptq"), qconfig(32, not act, act))
    fused_tensors = gptq_tensors(weights, fuse(qlin), "gptq")
    assert "model.layers.1.self_attn.qkv_proj.qweight" in fused_tensors
    assert "model.layers.1.mlp.gate_up_proj.g_idx" in fused_tensors
    assert not any(".q_proj." in k or ".gate_proj." in k for k in fused_tensors)
    fused = write(tmp_path / "fused", fused_tensors, qconfig(32, not act, act))
    a, b = run_logits(load(split)), run_logits(load(fused))
    np.testing.assert_array_equal(a, b)
    assert helpers.rel_err(a, dense_logits(tmp_path, weights, qlin)) < 1e-5


# ------------------------------------------------------------------------------------ 3. marlin-cpmcu
def test_marlin_cpmcu_with_copied_gptq_config(weights, sym32, tmp_path):
    """CPM.cu copies the source GPTQ config (checkpoint_format "gptq"); marlin is recognised from shapes."""
    gptq_path, qlin, ref = sym32
    tensors = marlin_tensors(weights, qlin)
    assert tensors["model.layers.0.self_attn.qkv_proj.qweight"].shape == (64 // 16, 2 * 192)
    assert not any(k.endswith((".qzeros", ".g_idx")) or ".q_proj." in k for k in tensors)
    path = write(tmp_path / "marlin", tensors, qconfig(32, True, fmt="gptq"), filename="model_gptq.safetensors")
    model = load(path)
    assert model.quant is not None and model.quant.group_size == 32 and model.quant.sym
    ours = run_logits(model)
    np.testing.assert_allclose(ours, run_logits(load(gptq_path)), rtol=1e-6, atol=1e-6)
    assert helpers.rel_err(ours, ref) < 1e-5
    # quant="none" dequantizes a marlin checkpoint too
    dense = load(path, quant="none")
    assert dense.quant is None and not is_int4(dense)
    assert helpers.rel_err(run_logits(dense), ref) < 1e-5


def test_marlin_per_channel_with_config(weights, tmp_path):
    """Per-channel marlin (group_size -1: Marlin's 32-column scale shuffle), config says so."""
    qlin = quantize_linears(weights, gs=-1, sym=True, seed=15)
    path = write(tmp_path / "marlin", marlin_tensors(weights, qlin), qconfig(-1, True, fmt="marlin", quant_method="marlin"),
                 filename="model_gptq.safetensors")
    model = load(path)
    assert model.quant.group_size == -1
    assert helpers.rel_err(run_logits(model), dense_logits(tmp_path, weights, qlin)) < 1e-5


def test_marlin_cpmcu_without_quantization_config_group32(weights, sym32, tmp_path):
    gptq_path, qlin, ref = sym32
    path = write(tmp_path / "marlin", marlin_tensors(weights, qlin), filename="model_gptq.safetensors")
    model = load(path)
    assert model.quant is not None and model.quant.group_size == 32
    assert helpers.rel_err(run_logits(model), ref) < 1e-5


# One wider decoder layer (hidden 256, 16 query heads, intermediate 512) for group sizes 128 and 256.
CFG_WIDE = helpers.tiny_minicpm_config(hidden_size=256, intermediate_size=512, num_attention_heads=16, num_hidden_layers=1)


def _marlin_and_oracle(tmp_path, cfg, gs, *, marlin_config=None, seed=12):
    """(marlin-cpmcu model, GPTQ checkpoint of the same weights, oracle logits)."""
    w = helpers.random_hf_weights(cfg, seed=seed)
    qlin = quantize_linears(w, gs=gs, sym=True)
    path = write(tmp_path / "marlin", marlin_tensors(w, qlin), marlin_config, cfg=cfg, filename="model_gptq.safetensors")
    gptq = write(tmp_path / "gptq", gptq_tensors(w, qlin, "gptq"), qconfig(gs, True), cfg=cfg)
    return load(path), gptq, dense_logits(tmp_path, w, qlin, cfg)


def test_marlin_cpmcu_without_quantization_config_default_group128(tmp_path):
    """The documented default of a config-less model_gptq.safetensors (sym, group 128), on CFG_WIDE where
    every linear has at least two groups of 128."""
    model, gptq, ref = _marlin_and_oracle(tmp_path, CFG_WIDE, 128)
    assert model.quant is not None and model.quant.group_size == 128 and model.quant.sym
    ours = run_logits(model)
    np.testing.assert_allclose(ours, run_logits(load(gptq)), rtol=1e-6, atol=1e-6)
    assert helpers.rel_err(ours, ref) < 1e-5


def test_marlin_cpmcu_single_group_linears(tmp_path):
    """Group 256 on CFG_WIDE: qkv / o_proj / gate_up (K = 256) have one scale group, so CPM.cu writes their
    scales with scale_perm_single; down_proj (K = 512) has two and is grouped."""
    model, _, ref = _marlin_and_oracle(tmp_path, CFG_WIDE, 256, marlin_config=qconfig(256, True))
    assert helpers.rel_err(run_logits(model), ref) < 1e-5


def test_convert_gptq_to_marlin_cpmcu_keeps_logits(sym32, tmp_path):
    from checkpoints_convert.gptq import convert_gptq

    gptq_path, _, ref = sym32
    convert_gptq(gptq_path, str(tmp_path / "marlin"), layout="marlin", progress=False)
    assert os.path.isfile(tmp_path / "marlin" / "model_gptq.safetensors")
    assert helpers.rel_err(run_logits(load(str(tmp_path / "marlin"))), ref) < 1e-5


# --------------------------------------------------------------------------------- 4. quant= conversions
def test_quant_none_dequantizes_a_gptq_checkpoint(sym32):
    path, _, ref = sym32
    int4_model = load(path)
    model = load(path, quant="none")
    assert model.quant is None and not is_int4(model)
    kernel = params(model)[("model", "layers", 2, "mlp", "gate_up_proj", "kernel")]
    assert kernel.dtype == np.float32 and kernel.shape == (64, 192)
    ours = run_logits(model)
    assert helpers.rel_err(ours, ref) < 1e-5
    assert helpers.rel_err(ours, run_logits(int4_model)) < 1e-5
    assert load(path, quant="int4").quant is not None  # already int4: kept as it is


def test_quant_int4_quantizes_a_dense_checkpoint(weights, tmp_path):
    dense_path = helpers.write_checkpoint(str(tmp_path / "dense"), CFG, weights)
    model = load(dense_path, quant="int4", group_size=32)
    assert model.quant is not None and model.quant.group_size == 32 and is_int4(model)
    # Independent oracle: RTN of each HF matrix, dequantized here, run as a dense model.
    oracle = dict(weights)
    for k, v in weights.items():
        if k.endswith("_proj.weight"):
            oracle[k] = np.ascontiguousarray(int4.rtn_quantize(v.T, group_size=32, sym=True).dequantize().T)
    ref = run_logits(load(helpers.write_checkpoint(str(tmp_path / "oracle"), CFG, oracle)))
    ours = run_logits(model)
    assert helpers.rel_err(ours, ref) < 1e-5
    assert helpers.rel_err(ours, run_logits(load(dense_path))) > 1e-3
    assert load(dense_path, quant="none").quant is None


@pytest.mark.parametrize(
    "gs, match",
    [(48, r"int4 group_size 48 does not divide a linear's 64 input features"),
     (40, r"group_size must be -1 \(per-channel\) or a positive multiple of 16, got 40"),
     (128, r"int4 group_size 128 does not divide a linear's 64 input features")],
    ids=["g48", "g40", "g128"],
)
def test_quant_int4_bad_group_size(weights, tmp_path, gs, match):
    dense_path = helpers.write_checkpoint(str(tmp_path / "dense"), CFG, weights)
    with pytest.raises(MiniCPMError, match=match):
        load(dense_path, quant="int4", group_size=gs)


# --------------------------------------------------------------------------------- 5. Pallas int4 matmul
# One decoder layer: Pallas interpret mode is slow on CPU, and one layer runs every int4 linear kind.
CFG1 = helpers.tiny_minicpm_config(num_hidden_layers=1)


def test_pallas_int4_gptq_actorder_matches_xla(tmp_path):
    w = helpers.random_hf_weights(CFG1, seed=13)
    qlin = quantize_linears(w, gs=32, sym=False, act_order=True, seed=6)
    path = write(tmp_path / "gptq", gptq_tensors(w, qlin, "gptq"), qconfig(32, False, True), cfg=CFG1)
    xla = run_logits(load(path))
    pallas = load(path, attention_impl="pallas")
    assert pallas.attention_impl == "pallas"
    assert pallas.model.layers[0].mlp.down_proj.impl == "pallas"
    ours = run_logits(pallas)
    assert helpers.rel_err(ours, xla) < 1e-4
    assert helpers.rel_err(ours, dense_logits(tmp_path, w, qlin, CFG1)) < 1e-4


def test_pallas_int4_marlin_matches_xla(tmp_path):
    w = helpers.random_hf_weights(CFG1, seed=14)
    qlin = quantize_linears(w, gs=32, sym=True)
    path = write(tmp_path / "marlin", marlin_tensors(w, qlin), qconfig(32, True), cfg=CFG1,
                 filename="model_gptq.safetensors")
    ours = run_logits(load(path, attention_impl="pallas"))
    assert helpers.rel_err(ours, run_logits(load(path))) < 1e-4
    assert helpers.rel_err(ours, dense_logits(tmp_path, w, qlin, CFG1)) < 1e-4


# ------------------------------------------------------------------------------------ 6. native round trip
@pytest.mark.parametrize("act", [False, True], ids=["sym-g32", "asym-actorder"])
def test_native_round_trip_of_int4_model(weights, tmp_path, act):
    qlin = quantize_linears(weights, gs=32, sym=not act, act_order=act, seed=8)
    model = load(write(tmp_path / "gptq", gptq_tensors(weights, qlin, "gptq"), qconfig(32, not act, act)))
    save_native(model, str(tmp_path / "native"))
    back = load(str(tmp_path / "native"))
    assert back.quant == model.quant
    a, b = params(model), params(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    qw = b[("model", "layers", 1, "self_attn", "o_proj", "qweight")]
    sc = b[("model", "layers", 1, "self_attn", "o_proj", "scales")]
    assert qw.dtype == np.int32 and sc.dtype == np.float32
    if act:
        assert b[("model", "layers", 1, "mlp", "gate_up_proj", "perm")].dtype == np.int32
        assert b[("model", "layers", 1, "mlp", "gate_up_proj", "zeros")].dtype == np.float32
    np.testing.assert_array_equal(run_logits(back), run_logits(model))


# ------------------------------------------------------------------------------------------ 7. bad input
def _drop(tensors, *names):
    return {k: v for k, v in tensors.items() if k not in names}


@pytest.fixture(scope="module")
def sym_tensors(weights, sym32):
    return gptq_tensors(weights, sym32[1], "gptq")


@pytest.fixture(scope="module")
def asym_tensors(weights):
    return gptq_tensors(weights, quantize_linears(weights, gs=32, sym=False, seed=9), "gptq")


def _expect_error(path, *substrings):
    with pytest.raises(MiniCPMError) as e:
        load(path)
    msg = str(e.value)
    for s in substrings:
        assert s in msg, (s, msg)
    return msg


def test_missing_scales_is_named(sym_tensors, tmp_path):
    path = write(tmp_path / "c", _drop(sym_tensors, "model.layers.1.mlp.down_proj.scales"), qconfig(32, True))
    _expect_error(path, "missing tensor model.layers.1.mlp.down_proj.scales", "[3, 64]")


@pytest.mark.parametrize(
    "change, substrings",
    [
        ({"bits": 8}, ["quantization_config.bits", "8", "4-bit"]),
        ({"bits": 3}, ["quantization_config.bits", "3"]),
        ({"quant_method": "awq"}, ["quantization_config.quant_method", "'awq'", "not supported"]),
        ({"lm_head": True}, ["quantization_config.lm_head", "lm_head must stay unquantized"]),
        ({"group_size": 48}, ["group_size 48 does not divide", "64 input features"]),
        ({"group_size": 40}, ["quantization_config.group_size = 40", "multiple of 16"]),
        ({"checkpoint_format": "foo"}, ["quantization_config.checkpoint_format", "'foo'"]),
    ],
    ids=["bits8", "bits3", "awq", "lm_head", "group48", "group40", "format_foo"],
)
def test_unsupported_quantization_config(sym_tensors, tmp_path, change, substrings):
    path = write(tmp_path / "c", sym_tensors, dict(qconfig(32, True), **change))
    _expect_error(path, *substrings)


def test_unsupported_old_quantize_config_json(sym_tensors, tmp_path):
    path = write(tmp_path / "c", sym_tensors)
    with open(os.path.join(path, "quantize_config.json"), "w") as f:
        json.dump({"bits": 8, "group_size": 32, "sym": True, "desc_act": False}, f)
    _expect_error(path, "quantization_config.bits", "8")


def test_qweight_with_wrong_shape(sym_tensors, tmp_path):
    t = dict(sym_tensors)
    t["model.layers.0.self_attn.k_proj.qweight"] = np.zeros((8, 16), np.int32)
    path = write(tmp_path / "c", t, qconfig(32, True))
    _expect_error(path, "tensor model.layers.0.self_attn.k_proj.qweight has shape [8, 16], expected [8, 32]")


def test_asymmetric_without_qzeros(asym_tensors, tmp_path):
    t = {k: v for k, v in asym_tensors.items() if not k.endswith(".qzeros")}
    path = write(tmp_path / "c", t, qconfig(32, False))
    _expect_error(path, "missing tensor model.layers.0.self_attn.q_proj.qzeros", "[2, 16]")


def test_symmetric_config_on_asymmetric_zeros(asym_tensors, tmp_path):
    path = write(tmp_path / "c", asym_tensors, qconfig(32, True))
    _expect_error(path, "qzeros", "sym=true")


def test_quantization_config_without_qweights(weights, tmp_path):
    path = write(tmp_path / "c", weights, qconfig(32, True))
    _expect_error(path, "declares quantization", "no *.qweight tensors")


def test_qweights_without_quantization_config(sym_tensors, tmp_path):
    path = write(tmp_path / "c", sym_tensors)
    _expect_error(path, "*.qweight tensors but no quantization_config", "quantize_config.json")


def test_nontrivial_g_idx_without_desc_act(weights, tmp_path):
    qlin = quantize_linears(weights, gs=32, sym=True, act_order=True, seed=10)
    path = write(tmp_path / "c", gptq_tensors(weights, qlin, "gptq"), qconfig(32, True, act=False))
    _expect_error(path, "g_idx reorders rows although the config says desc_act=false", "model.layers.0.self_attn.q_proj")


def test_marlin_shapes_with_asymmetric_config(weights, sym32, tmp_path):
    path = write(tmp_path / "c", marlin_tensors(weights, sym32[1]), qconfig(32, False),
                 filename="model_gptq.safetensors")
    _expect_error(path, "Marlin-packed", "sym=false")
