"""EAGLE draft checkpoint layouts: CPM.cu's MiniCPM EAGLE, vLLM's (with and without its unused
``model.norm``), EAGLE-3 with ``midlayer.*`` and with ``layers.0.*`` / ``model.layers.0.*`` (dense, and int4
Marlin as CPM.cu's gptq2marlin writes it). Every renamed layout loads to exactly the canonical draft;
vLLM's draft computes vLLM's math (a NumPy re-derivation); greedy speculative decoding with each draft
gives the plain greedy tokens; EAGLE-3's target features are the residual streams transformers returns
as ``hidden_states`` (what the published MiniCPM4.1 EAGLE-3 drafts were trained on, unscaled)."""

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import SpeculativeEngine
from minicpm_jax.engine.speculative.rounds import SpecConfig, target_forward
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io import int4_formats
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.loading import load_draft, load_model
from tests.helpers import random_hf_weights, tiny_minicpm_config, write_checkpoint
from tests.oracles import hf_llama_with_minicpm_folded

MAX_LEN = 64
LAYERS = 6  # EAGLE-3 captures the residual streams entering layers (2, 3, 3)
MUP = 5.0  # the vLLM drafts' mup_denominator: residual scale scale_depth / sqrt(5), not CPM.cu's
PROMPTS = [[3, 7, 9, 11, 4, 30], [5, 6, 7, 8]]
SPEC = SpecConfig(num_iter=2, topk_per_iter=3, tree_size=6)


def _cfg():
    return tiny_minicpm_config(num_hidden_layers=LAYERS, vocab_size=61, rope_scaling=None)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    cfg = _cfg()
    w = random_hf_weights(cfg, seed=3, std=0.15)
    path = write_checkpoint(str(tmp_path_factory.mktemp("target")), cfg, w)
    return load_model(path, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse="off"), cfg, w, path


def _tensors(path) -> dict[str, np.ndarray]:
    return load_file(os.path.join(path, "model.safetensors"))


def _config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _write(path, tensors, config) -> str:
    os.makedirs(path)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def _vllm_names(tensors, target_w, norm):
    """CPM.cu names → vLLM's EagleMiniCPM names (written here from vLLM's module tree: ``model.`` prefix,
    ``eagle_layers``, no fc bias, copies of the target's embedding and head, optionally ``model.norm``)."""
    out = {"model.embed_tokens.weight": target_w["model.embed_tokens.weight"], "lm_head.weight": target_w["lm_head.weight"]}
    for name, value in tensors.items():
        if name != "fc.bias":
            out["model." + name.replace("layers.0.", "eagle_layers.0.")] = value
    if norm is not None:
        out["model.norm.weight"] = norm
    return out


H, HEADS, KV_HEADS, HEAD_DIM, MLP, V_D = 64, 8, 2, 16, 96, 40
LAYER_CONFIG = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
                "intermediate_size": MLP, "num_hidden_layers": 1}


def _layer(rng, prefix: str, attention_in: int) -> dict[str, np.ndarray]:
    """One decoder layer's tensors (HF names, ``[out, in]``), random norm gains included."""
    def mat(*shape):
        return (0.15 * rng.standard_normal(shape)).astype(np.float32)

    out = {prefix + n: (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32)
           for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    out.update({prefix + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, attention_in),
                prefix + "self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, attention_in),
                prefix + "self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, attention_in),
                prefix + "self_attn.o_proj.weight": mat(H, HEADS * HEAD_DIM),
                prefix + "mlp.gate_proj.weight": mat(MLP, H), prefix + "mlp.up_proj.weight": mat(MLP, H),
                prefix + "mlp.down_proj.weight": mat(H, MLP)})
    return out


def _gain(rng):
    return (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """{layout: draft directory}: two canonical random drafts written by hand from the published layouts
    (MiniCPM EAGLE in CPM.cu names without fc.bias, as vLLM's has none; EAGLE-3 in SafeAILab names) and
    their renamings."""
    model, target_w = target[0], target[2]
    root = tmp_path_factory.mktemp("drafts")
    rng = np.random.default_rng(1)
    canon = {"fc.weight": (0.15 * rng.standard_normal((H, 2 * H))).astype(np.float32),
             "input_norm1.weight": _gain(rng), "input_norm2.weight": _gain(rng), **_layer(rng, "layers.0.", H)}
    out = {"cpmcu": _write(root / "cpmcu", canon, LAYER_CONFIG)}
    vcfg = dict(LAYER_CONFIG, mup_denominator=MUP, scale_depth=1.4)
    out["vllm-cpmcu-math"] = _write(root / "vllm-cpmcu-math", _vllm_names(canon, target_w, None), LAYER_CONFIG)
    out["vllm+norm"] = _write(root / "vllm+norm", _vllm_names(canon, target_w, _gain(rng)), vcfg)
    out["vllm"] = _write(root / "vllm", _vllm_names(canon, target_w, None), vcfg)

    used = np.sort(rng.choice(model.config.vocab_size, V_D, replace=False))
    canon3 = {"fc.weight": (0.15 * rng.standard_normal((H, 3 * H))).astype(np.float32),
              **_layer(rng, "midlayer.", 2 * H), "midlayer.hidden_norm.weight": _gain(rng), "norm.weight": _gain(rng),
              "lm_head.weight": (0.3 * rng.standard_normal((V_D, H))).astype(np.float32),
              "d2t": (used - np.arange(V_D)).astype(np.int64),
              "t2d": np.isin(np.arange(model.config.vocab_size), used)}
    cfg3 = dict(LAYER_CONFIG, draft_vocab_size=V_D)
    out["midlayer"] = _write(root / "midlayer", canon3, cfg3)
    for layout, prefix in (("layers.0", "layers.0."), ("model.layers.0", "model.layers.0.")):
        renamed = {(prefix + n[len("midlayer."):] if n.startswith("midlayer.") else n): v for n, v in canon3.items()}
        out[layout] = _write(root / layout, renamed, cfg3)
    return out


def _load(path, model):
    return load_draft(path, model.config, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32)


def _assert_same_draft(a: EagleDraft, b: EagleDraft):
    assert a.spec == b.spec
    fa, fb = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
    assert fa.keys() == fb.keys()
    for key in fa:
        np.testing.assert_array_equal(np.asarray(fa[key][...]), np.asarray(fb[key][...]), err_msg=str(key))


@pytest.mark.parametrize("layout, canonical", [
    ("vllm-cpmcu-math", "cpmcu"), ("vllm", "vllm+norm"), ("layers.0", "midlayer"), ("model.layers.0", "midlayer"),
])
def test_renamed_layouts_load_to_exactly_the_canonical_draft(target, drafts, layout, canonical):
    model = target[0]
    _assert_same_draft(_load(drafts[layout], model), _load(drafts[canonical], model))


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def _vllm_eagle_minicpm_logits(t: dict, draft_cfg: dict, cfg: dict, tokens, feats):
    """vLLM's EagleMiniCPMForCausalLM (vllm/model_executor/models/minicpm_eagle.py) in NumPy, from its
    forward: fc([input_norm1(E·scale_emb); input_norm2(f)]) (no bias), eagle layers with both branches
    × scale_depth/sqrt(mup_denominator), then ``hidden / scale_width`` into lm_head. ``model.norm`` is
    built there and never applied."""
    W = {k: v.astype(np.float64) for k, v in t.items()}
    h, d, eps = cfg["hidden_size"], cfg["head_dim"], cfg["rms_norm_eps"]
    nh, nkv = draft_cfg["num_attention_heads"], draft_cfg["num_key_value_heads"]
    n = len(tokens)
    e = W["model.embed_tokens.weight"][tokens] * cfg["scale_emb"]
    x = np.concatenate([_rms(e, W["model.input_norm1.weight"], eps), _rms(feats, W["model.input_norm2.weight"], eps)], -1)
    x = x @ W["model.fc.weight"].T
    s = draft_cfg["scale_depth"] / math.sqrt(draft_cfg["mup_denominator"])
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)

    def rope(v):
        return v * cos[:, None] + np.concatenate([-v[..., d // 2:], v[..., : d // 2]], -1) * sin[:, None]

    p = "model.eagle_layers.0."
    a = _rms(x, W[p + "input_layernorm.weight"], eps)
    q = rope((a @ W[p + "self_attn.q_proj.weight"].T).reshape(n, nh, d))
    k = rope((a @ W[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, d))
    v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, d)
    o = np.zeros((n, nh, d))
    for head in range(nh):
        sc = q[:, head] @ k[:, head // (nh // nkv)].T / math.sqrt(d)
        sc = np.where(np.tril(np.ones((n, n), bool)), sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, head // (nh // nkv)]
    x = x + s * (o.reshape(n, nh * d) @ W[p + "self_attn.o_proj.weight"].T)
    m = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
    g = m @ W[p + "mlp.gate_proj.weight"].T
    x = x + s * (((g / (1 + np.exp(-g))) * (m @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T)
    return (x / (h / cfg["dim_model_base"])) @ W["lm_head.weight"].T


@nnx.jit
def _draft_step(model, draft, tokens, feats):
    """Draft logits of one causal step from an empty draft cache (the target's head, or EAGLE-3's own)."""
    t = tokens.shape[1]
    hidden, _ = draft(model.embed(tokens), feats, jnp.arange(t)[None], jnp.ones((1, t), bool), draft.new_cache(1, 16))
    return draft.logits(hidden) if draft.own_head else model.logits(hidden)


def test_vllm_draft_with_norm_computes_vllms_math(target, drafts):
    model, cfg = target[:2]
    draft = _load(drafts["vllm+norm"], model)
    assert draft.spec.kind == "minicpm" and draft.spec.residual_scale == pytest.approx(1.4 / math.sqrt(MUP))
    tokens = np.array([4, 17, 2, 9, 33])
    feats = np.random.default_rng(5).standard_normal((5, 64)).astype(np.float32)
    got = np.asarray(_draft_step(model, draft, jnp.asarray(tokens)[None], jnp.asarray(feats)[None]))[0]
    raw = _tensors(drafts["vllm+norm"])
    want = _vllm_eagle_minicpm_logits(raw, _config(drafts["vllm+norm"]), cfg,
                                      tokens, feats.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_eagle3_features_are_the_transformers_hidden_states_unscaled(target, drafts):
    """MiniCPM4.1's EAGLE-3 drafts were trained on transformers' ``output_hidden_states`` of the MiniCPM
    modeling (the residual stream entering a layer, no extra scale); the folded Llama oracle has the
    same residual stream. What the engine hands the draft's fc is those, concatenated low→high."""
    import torch

    model, cfg, w = target[:3]
    draft = _load(drafts["midlayer"], model)
    assert draft.spec.capture == (2, 3, 3)
    tokens = np.array([[1, 8, 22, 5, 40, 13, 7]])
    _, feats, _ = target_forward(model, draft, jnp.asarray(tokens), model.new_cache(1), jnp.asarray([7]))
    with torch.no_grad():
        hs = hf_llama_with_minicpm_folded(cfg, w)(torch.from_numpy(tokens), output_hidden_states=True).hidden_states
    want = np.concatenate([hs[i][0].numpy() for i in draft.spec.capture], -1)
    np.testing.assert_allclose(np.asarray(feats)[0], want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def plain_greedy(target):
    out, _ = Engine(target[0], batch_size=2, chunk_length=16).generate(PROMPTS, max_new_tokens=10)
    return [r.token_ids for r in out]


# One draft per distinct computation: "vllm" and "midlayer" load to exactly the drafts of "vllm+norm" and
# "layers.0" (test_renamed_layouts_load_to_exactly_the_canonical_draft), so they decode the same tokens.
@pytest.mark.parametrize("layout", ["cpmcu", "vllm+norm", "layers.0"])
def test_greedy_speculative_with_each_layout_equals_plain_greedy(target, drafts, plain_greedy, layout):
    model = target[0]
    engine = SpeculativeEngine(model, _load(drafts[layout], model), spec=SPEC, batch_size=2, chunk_length=16)
    out, _ = engine.generate(PROMPTS, max_new_tokens=10)
    assert [r.token_ids for r in out] == plain_greedy


def _marlin_eagle3(tensors: dict[str, np.ndarray], prefix: str, group: int):
    """An EAGLE-3 draft as CPM.cu's gptq2marlin.py writes it (fc, fused qkv / gate_up in Marlin int4,
    scales fp16 permuted; norms, lm_head, d2t dense), its layer under ``prefix``; and the dense tensors of
    its dequantized weights (SafeAILab names)."""
    fuse = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
            "self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",)}
    marlin, dense = {}, {n: v for n, v in tensors.items() if v.ndim != 2 or n == "lm_head.weight"}
    linears = {"fc": ["fc.weight"]}
    for fused, parts in fuse.items():
        module = fused.split(".")[0]
        linears["midlayer." + fused] = [f"midlayer.{module}.{p}.weight" for p in parts]
    for name, parts in linears.items():
        w = np.concatenate([tensors[p] for p in parts], 0).T  # [K, N]
        q = int4_formats.rtn_quantize(np.ascontiguousarray(w), group_size=group)
        q = dataclasses.replace(q, scales=q.scales.astype(np.float16).astype(np.float32))  # as stored
        scales = q.scales.astype(np.float16)
        deq = q.dequantize().T
        widths = np.cumsum([tensors[p].shape[0] for p in parts])[:-1]
        dense.update(zip(parts, np.split(deq, widths, 0)))
        out = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
        marlin[out + ".qweight"] = int4_formats.marlin_pack(q.q)
        marlin[out + ".scales"] = int4_formats.marlin_permute_scales(scales, per_channel=False)
    for n, v in tensors.items():
        if not (v.ndim == 2 and n != "lm_head.weight"):
            marlin[prefix + n[len("midlayer."):] if n.startswith("midlayer.") else n] = v
    return marlin, dense


def test_int4_marlin_eagle3_in_both_namings(target, drafts, tmp_path):
    model = target[0]
    canon = _tensors(drafts["midlayer"])
    cfg3 = _config(drafts["midlayer"])
    qcfg = dict(cfg3, quantization_config={"bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                                           "checkpoint_format": "gptq", "quant_method": "gptq"})
    loaded = {}
    for prefix in ("midlayer.", "model.layers.0."):
        marlin, dense = _marlin_eagle3(canon, prefix, 32)
        loaded[prefix] = _load(_write(tmp_path / prefix, marlin, qcfg), model)
    assert type(loaded["midlayer."].fc).__name__ == "Int4Linear"
    _assert_same_draft(loaded["midlayer."], loaded["model.layers.0."])
    deq = _load(_write(tmp_path / "deq", dense, cfg3), model)
    tokens = jnp.asarray([[4, 17, 2, 9, 33]])
    feats = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 3 * H)), jnp.float32)
    np.testing.assert_allclose(np.asarray(_draft_step(model, loaded["midlayer."], tokens, feats)),
                               np.asarray(_draft_step(model, deq, tokens, feats)), rtol=1e-4, atol=1e-4)


def test_layout_errors_and_the_vllm_writer(target, drafts, tmp_path):
    from checkpoints_convert.eagle import convert_eagle

    model, path = target[0], target[3]
    e3 = _tensors(drafts["layers.0"])
    e3["layers.1.mlp.down_proj.weight"] = e3["layers.0.mlp.down_proj.weight"]
    with pytest.raises(MiniCPMError, match="only one-layer drafts"):
        _load(_write(tmp_path / "two", e3, {}), model)
    # The vLLM writer adds the model.norm vLLM's loader insists on; it reads back to the same draft.
    assert convert_eagle(drafts["vllm"], str(tmp_path / "out"), layout="vllm", target=path) == "minicpm"
    names = set(_tensors(tmp_path / "out"))
    assert {"model.norm.weight", "model.fc.weight", "model.eagle_layers.0.mlp.up_proj.weight"} <= names
    _assert_same_draft(_load(str(tmp_path / "out"), model), _load(drafts["vllm"], model))
    assert convert_eagle(drafts["layers.0"], str(tmp_path / "e3"), layout="cpmcu") == "eagle3"
    assert "midlayer.hidden_norm.weight" in _tensors(tmp_path / "e3")
