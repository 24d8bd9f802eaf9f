"""Checkpoint loading (single file, sharded, dtypes) and the clear errors for bad checkpoints and configs."""

import os
import shutil

import numpy as np
import jax.numpy as jnp
import pytest

from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.loading import load_model
from tests import helpers


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _params(model):
    from flax import nnx

    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_sharded_equals_single_file(tiny_ckpt, tmp_path):
    path, cfg, weights = tiny_ckpt
    sharded = helpers.write_checkpoint(str(tmp_path / "sharded"), cfg, weights, shards=3)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a, b = _params(load_model(path, dtype=jnp.float32)), _params(load_model(sharded, dtype=jnp.float32))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    # Layout: fused qkv kernel is [hidden, q|k|v] with the HF matrices transposed.
    qkv = a[("model", "layers", 1, "self_attn", "qkv_proj", "kernel")]
    np.testing.assert_array_equal(qkv[:, :128], weights["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(qkv[:, 128 + 32:], weights["model.layers.1.self_attn.v_proj.weight"].T)


@pytest.mark.parametrize("store", ["float16", "bfloat16"])
def test_half_precision_checkpoints_convert_to_chosen_dtype(tiny_ckpt, tmp_path, store):
    import ml_dtypes

    _, cfg, weights = tiny_ckpt
    np_dtype = np.float16 if store == "float16" else ml_dtypes.bfloat16
    path = helpers.write_checkpoint(str(tmp_path / store), cfg, {k: v.astype(np_dtype) for k, v in weights.items()})
    model = load_model(path, dtype=jnp.bfloat16)
    p = _params(model)
    assert all(v.dtype == jnp.bfloat16 for v in p.values())
    ref = weights["model.layers.0.mlp.down_proj.weight"].astype(np_dtype).astype(np.float32).T
    np.testing.assert_allclose(p[("model", "layers", 0, "mlp", "down_proj", "kernel")].astype(np.float32), ref, rtol=1e-2, atol=1e-3)


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    _, cfg, weights = tiny_ckpt
    w = dict(weights)
    del w["model.layers.2.mlp.up_proj.weight"]
    path = helpers.write_checkpoint(str(tmp_path / "ckpt"), cfg, w)
    with pytest.raises(MiniCPMError, match=r"missing tensor model\.layers\.2\.mlp\.up_proj\.weight \(expected shape \[96, 64\]\)"):
        load_model(path)


def test_misshaped_and_unexpected_tensors_are_listed_together(tiny_ckpt, tmp_path):
    _, cfg, weights = tiny_ckpt
    w = dict(weights)
    w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    w["model.layers.9.extra.weight"] = np.zeros(3, np.float32)
    path = helpers.write_checkpoint(str(tmp_path / "ckpt"), cfg, w)
    with pytest.raises(MiniCPMError) as e:
        load_model(path)
    msg = str(e.value)
    assert "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]" in msg
    assert "unexpected tensor model.layers.9.extra.weight" in msg


def test_truncated_safetensors_file(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt[0], tmp_path / "ckpt")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(MiniCPMError, match="model.safetensors is not a readable safetensors file.*truncated"):
        load_model(path)


def test_missing_shard_named_by_index(tiny_ckpt, tmp_path):
    _, cfg, weights = tiny_ckpt
    path = helpers.write_checkpoint(str(tmp_path / "ckpt"), cfg, weights, shards=2)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(MiniCPMError, match="shard files that are missing: model-00002-of-00002.safetensors"):
        load_model(path)


def test_no_config_and_no_weights(tiny_ckpt, tmp_path):
    with pytest.raises(MiniCPMError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MiniCPMError, match="no config.json in"):
        load_model(str(empty))
    only_cfg = tmp_path / "only_cfg"
    only_cfg.mkdir()
    shutil.copy(os.path.join(tiny_ckpt[0], "config.json"), only_cfg)
    with pytest.raises(MiniCPMError, match=r"no \*\.safetensors files"):
        load_model(str(only_cfg))


def test_unstated_tie_is_decided_by_the_checkpoint(tiny_ckpt, tmp_path):
    _, cfg, weights = tiny_ckpt
    cfg = {k: v for k, v in cfg.items() if k != "tie_word_embeddings"}
    untied = load_model(helpers.write_checkpoint(str(tmp_path / "a"), cfg, weights))
    assert untied.config.tie_word_embeddings is False
    w = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    tied = load_model(helpers.write_checkpoint(str(tmp_path / "b"), cfg, w))
    assert tied.config.tie_word_embeddings is True


# ----------------------------------------------------------------------------- config
MINICPM4_8B = {
    "architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm", "bos_token_id": 1, "eos_token_id": [2, 73440],
    "pad_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 16384,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 64, "short_factor": [1.0] * 64,
                                            "original_max_position_embeddings": 32768},
    "vocab_size": 73448, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4, "tie_word_embeddings": False,
    "sparse_config": {"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64, "window_size": 2048,
                      "topk": 64, "use_nope": False, "dense_len": 8192},
    "quantization_config": {"bits": 4, "group_size": 128, "sym": True},
}


def test_minicpm4_config_parses():
    c = ModelConfig.from_dict(MINICPM4_8B)
    assert (c.head_dim, c.num_kv_heads, c.eos_token_ids) == (128, 2, (2, 73440))
    assert c.rope.kind == "longrope" and c.rope.original_max_position_embeddings == 32768
    assert c.residual_scale == pytest.approx(1.4 / 32**0.5) and c.logit_scale == 1 / 16
    assert c.sparse.dense_len == 8192 and c.sparse.topk == 64
    assert c.quantization == {"bits": 4, "group_size": 128, "sym": True}
    assert 8.0e9 < c.num_params < 8.4e9
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    hash(c)  # static under jit


def test_llama_config_has_neutral_scalings():
    raw = dict(MINICPM4_8B, model_type="llama")
    for k in ("scale_emb", "dim_model_base", "scale_depth", "rope_scaling"):
        raw.pop(k)
    c = ModelConfig.from_dict(raw)
    assert c.scale_emb == 1 and c.residual_scale == pytest.approx(1.0) and c.logit_scale == 1.0


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4}}, "rope_type 'dynamic' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                           "original_max_position_embeddings": 8}}, "short_factor must be a list of 64"),
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"hidden_size": "big"}, "'hidden_size' must be int"),
        ({"vocab_size": None}, "required field 'vocab_size' is missing"),
        ({"sparse_config": {"topk": -1}}, "sparse_config.topk must be an integer >= 0"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
    ],
)
def test_bad_configs_name_the_field(change, msg, tmp_path):
    raw = dict(MINICPM4_8B, **change)
    with pytest.raises(MiniCPMError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_dict(raw)


def test_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(MiniCPMError, match="cannot read .*config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_eagle3_draft_config_may_name_its_feature_layers():
    """vLLM / SpecForge's ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``) replace
    the default (2, L//2, L-3); anything but three layer indices of the target is refused."""
    from minicpm_jax.config import DraftSpec

    target = ModelConfig.from_dict(MINICPM4_8B)
    assert DraftSpec.from_config({}, target, "eagle3").capture == (2, 16, 29)
    assert DraftSpec.from_config({"eagle_aux_hidden_state_layer_ids": [1, 16, 30]}, target, "eagle3").capture == (1, 16, 30)
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 15, 28]}}
    assert DraftSpec.from_config(nested, target, "eagle3").capture == (3, 15, 28)
    with pytest.raises(MiniCPMError, match="eagle_aux_hidden_state_layer_ids must be 3 layer indices"):
        DraftSpec.from_config({"eagle_aux_hidden_state_layer_ids": [1, 2, 32]}, target, "eagle3")
