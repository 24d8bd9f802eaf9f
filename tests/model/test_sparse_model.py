"""InfLLM-v2 in the model: settings and the dense/sparse policy, incremental compressed caches,
sparse-vs-dense equivalences, prefill/decode agreement, the Pallas backend against the XLA one, use_nope,
generation with dense and sparse rows, and speculative-tree verification of each node as plain sparse
decoding of its path. The kernels: ``tests/kernels/test_infllm_kernels.py``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.attention import sparse_attention, tree_sparse_attention
from minicpm_jax.infllm.compressed import extend_compressed
from minicpm_jax.infllm.policy import attention_mode, resolve_sparse
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.rope import rope_inverse
from pallas_kernels import backend
from tests import helpers
from tests.helpers import SMALL, random_tree
from tests.oracles import np_compress

MAX_LEN = 128


def _config(sparse: SparseConfig | None = SMALL) -> ModelConfig:
    raw = helpers.tiny_minicpm_config(sparse_config=None if sparse is None else dataclasses.asdict(sparse))
    if sparse is None:
        del raw["sparse_config"]
    return ModelConfig.from_dict(raw)


def _model(sparse="auto", impl="xla", config=None, max_length=MAX_LEN):
    return MiniCPMForCausalLM(config or _config(), max_length=max_length, attention_impl=impl, rngs=nnx.Rngs(0),
                              sparse=sparse)


# The tree attention and its oracle's calls jitted, as the model runs them (op by op, the first case took
# 20 s on the CPU, compiling each small op); the same programs serve the three prefixes.
_extend = jax.jit(extend_compressed, static_argnums=(1, 4), static_argnames=("max_tokens", "kernels", "unrotate"))
_sparse_attention = jax.jit(sparse_attention, static_argnums=(3, 6), static_argnames=("scale", "kernels"))
_tree_sparse_attention = jax.jit(tree_sparse_attention, static_argnums=(6, 9),
                                 static_argnames=("scale", "kernels", "unrotate"))


@functools.cache
def _unrotate():
    """use_nope's inverse RoPE of the tiny config (head_dim 16), one function for every case."""
    return rope_inverse(jnp.asarray(1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16), jnp.float32), 1.0)


@pytest.mark.parametrize("impl,use_nope", [("xla", False), ("pallas", False), ("xla", True)])
@pytest.mark.parametrize("prefix", [45, 62, 70])
def test_tree_sparse_attention_equals_plain_sparse_decoding_of_each_path(impl, use_nope, prefix):
    """Every tree node against ``sparse_attention`` run at its position on a cache where its ancestor path
    was committed (keys written in order, K1/K2 extended): the coarse window that the path closes, the
    forced local blocks holding the path, and the LSE merge of prefix blocks and tree keys."""
    sp = dataclasses.replace(SMALL, topk=4, use_nope=use_nope)  # 2 free picks besides the init and 3 local blocks
    # use_nope: selection on pre-RoPE q and keys (keys recovered by rotating the cached ones back)
    unrotate = _unrotate() if use_nope else None
    cfg = ModelConfig.from_dict(helpers.tiny_minicpm_config())
    b, kvh, h, d, s, t = 1, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim, 96, 12
    rng = np.random.default_rng(prefix)
    depth, mask = random_tree(rng, t, 3)
    cache = KVCache.create(cfg, b, s, jnp.float32, sp)
    # heads of a group with different scales: their LSEs differ, so the coarse window matters for selection
    k = rng.standard_normal((cfg.num_layers, b, kvh, s, d)).astype(np.float32)
    v = rng.standard_normal((cfg.num_layers, b, kvh, s, d)).astype(np.float32)
    q = (rng.standard_normal((b, t, h, d)) * np.linspace(0.3, 3.0, h)[None, None, :, None]).astype(np.float32)
    q_sel = (rng.standard_normal((b, t, h, d)) * np.linspace(0.3, 3.0, h)[None, None, :, None]).astype(np.float32) if use_nope else q
    tree_k = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    tree_v = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    base = dataclasses.replace(cache, k=jnp.asarray(k), v=jnp.asarray(v))
    xla = backend.get("xla")
    base = _extend(base, 1, jnp.zeros(b, jnp.int32), jnp.full(b, prefix, jnp.int32), sp, max_tokens=s, kernels=xla,
                   unrotate=unrotate)
    pre = jnp.full((b,), prefix, jnp.int32)
    tree_cache = dataclasses.replace(
        base, k=base.k.at[1, 0, :, prefix:prefix + t].set(jnp.asarray(tree_k[0]).transpose(1, 0, 2)),
        v=base.v.at[1, 0, :, prefix:prefix + t].set(jnp.asarray(tree_v[0]).transpose(1, 0, 2)))
    got = np.asarray(_tree_sparse_attention(jnp.asarray(q), jnp.asarray(q_sel), jnp.asarray(tree_k),
                                            jnp.asarray(tree_v), jnp.asarray(mask[None]), tree_cache, 1, pre,
                                            jnp.asarray(depth[None], jnp.int32), sp, scale=d**-0.5,
                                            kernels=backend.get(impl), unrotate=unrotate))
    closes = False
    for i in range(t):
        path = sorted(np.nonzero(mask[i])[0], key=lambda j: depth[j])
        pos = prefix + depth[i]
        ck = base.k.at[1, 0, :, prefix:pos + 1].set(jnp.asarray(tree_k[0, path]).transpose(1, 0, 2))
        cv = base.v.at[1, 0, :, prefix:pos + 1].set(jnp.asarray(tree_v[0, path]).transpose(1, 0, 2))
        c = _extend(dataclasses.replace(base, k=ck, v=cv), 1, pre, jnp.full((b,), pos + 1, jnp.int32), sp,
                    max_tokens=8, kernels=xla, unrotate=unrotate)
        want = _sparse_attention(jnp.asarray(q[:, i:i + 1]), jnp.asarray(q_sel[:, i:i + 1]), c, 1,
                                 jnp.full((b, 1), pos, jnp.int32), jnp.full((b,), pos + 1, jnp.int32), sp,
                                 scale=d**-0.5, kernels=xla)
        np.testing.assert_allclose(got[:, i], np.asarray(want)[:, 0], rtol=1e-4, atol=1e-5, err_msg=f"node {i}")
        closes |= pos + 1 >= ((prefix - sp.kernel_size2) // sp.kernel_stride2 + 1) * sp.kernel_stride2 + sp.kernel_size2
    assert closes  # some node's path closes a coarse window (its own copy joins the LSE)


# ------------------------------------------------------------------------------------------- the model


_forward = jax.jit(lambda m, c, x: m(x, c))


def _ids(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 97, (1, n)), jnp.int32)


def test_compressed_caches_extend_exactly_over_a_300_token_decode():
    model = _model(max_length=320)
    sp = model.sparse
    cache = model.new_cache(1)
    step = jax.jit(lambda m, c, x: m(x, c)[2])
    cache = step(model, cache, _ids(8)[:, :7])
    tokens = np.random.default_rng(3).integers(0, 97, 300)
    for n, tok in enumerate(tokens):
        cache = step(model, cache, jnp.asarray([[tok]], jnp.int32))
        length = 8 + n
        assert int(cache.lengths[0]) == length
        k = np.asarray(cache.k)[:, 0, :, :length]  # [L, KVH, length, D] (sliced in NumPy: a jax slice per length compiles)
        for name, kernel, stride in (("k1", sp.kernel_size, sp.kernel_stride), ("k2", sp.kernel_size2, sp.kernel_stride2)):
            comp = np.asarray(getattr(cache, name))[:, 0]  # [L, KVH, windows, D]
            want = np_compress(k, kernel, stride)  # every layer and KV head at once
            np.testing.assert_allclose(comp[:, :, : want.shape[-2]], want, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} step {n} (axes: layer, KV head, window, dim)")


def test_sparse_equals_dense_below_dense_len_and_when_topk_covers_every_block():
    ids = _ids(89)  # the length of the prefill below: the sparse model's 89-token program is compiled once
    dense = _model(sparse="off")
    want, _, _ = _forward(dense, dense.new_cache(1), ids)
    # (1) context below dense_len: the dense path
    below = _model(sparse=dataclasses.replace(SMALL, dense_len=101))
    got, _, _ = _forward(below, below.new_cache(1), ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # (2) sparse from token 32 on, but topk covers all 12 blocks
    covered = _model(sparse=dataclasses.replace(SMALL, topk=16))
    got, _, cache = _forward(covered, covered.new_cache(1), ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # (3) the real selection (5 of up to 12 blocks) differs past position 5*8 = 40
    sparse = _model()
    got, _, _ = _forward(sparse, sparse.new_cache(1), ids)
    np.testing.assert_allclose(np.asarray(got[:, :40]), np.asarray(want[:, :40]), atol=1e-5)
    assert float(jnp.max(jnp.abs(got[:, 48:] - want[:, 48:]))) > 1e-3


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sparse_prefill_last_logits_equal_sparse_decode(impl):
    model = _model(impl=impl)
    ids = _ids(89, seed=4)
    full, _, _ = _forward(model, model.new_cache(1), ids)
    # the prefix in 8 chunks of 11 (boundaries off the 8-token blocks and the stride; one chunk crosses
    # dense_len 32), then the last token as a decode step: three programs (89, 11, 1 tokens), not four
    cache = model.new_cache(1)
    for start in range(0, 88, 11):
        _, _, cache = _forward(model, cache, ids[:, start:start + 11])
    last, _, _ = _forward(model, cache, ids[:, 88:])
    np.testing.assert_allclose(np.asarray(last[0, -1]), np.asarray(full[0, -1]), rtol=1e-4, atol=1e-5)


def test_pallas_sparse_model_matches_xla():
    """Every position of an 89-token prompt (sparse from 32, selection deciding past 40), jitted as the engine
    runs the model: the two programs of the prefill test above (eagerly, op by op, this took 20 s)."""
    ids = _ids(89, seed=5)
    ref, _, _ = _forward(m := _model(impl="xla"), m.new_cache(1), ids)
    got, _, _ = _forward(m := _model(impl="pallas"), m.new_cache(1), ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


def test_use_nope_selects_on_pre_rope_keys():
    """With use_nope the compressed caches hold means of pre-RoPE keys (recovered by rotating back)."""
    model = _model(sparse=dataclasses.replace(SMALL, use_nope=True))
    ids = _ids(89, seed=6)  # the dense model's 89-token program: compiled above
    a, _, cache = _forward(model, model.new_cache(1), ids)
    attn = model.model.layers[0].self_attn
    cfg = model.config
    x = model.model.layers[0].input_layernorm(
        model.model.embed_tokens(ids).astype(jnp.float32) * cfg.scale_emb)
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    k_nope = np.asarray(attn.qkv_proj(x)[0, :, nq:nq + nkv].reshape(89, cfg.num_kv_heads, cfg.head_dim))
    for g in range(cfg.num_kv_heads):
        want = np_compress(k_nope[:, g], SMALL.kernel_size, SMALL.kernel_stride)
        np.testing.assert_allclose(np.asarray(cache.k1[0, 0, g, : len(want)]), want, rtol=1e-4, atol=1e-5)
    dense = _model(sparse="off")
    b, _, _ = _forward(dense, dense.new_cache(1), ids)
    assert float(jnp.max(jnp.abs(a[:, 48:] - b[:, 48:]))) > 1e-3  # sparse from 32, selection differs


def test_generation_mixes_dense_and_sparse_rows_in_one_batch():
    """End to end through the engine: a batch with one prompt below dense_len (it crosses dense_len while
    decoding) and one above, greedy, equals each prompt generated alone by plain model calls (which pick
    the attention per row on device). The engine picked dense, mixed and sparse steps on the host."""
    model = _model()
    engine = Engine(model, batch_size=2, chunk_length=16)
    prompts = [list(np.random.default_rng(7).integers(3, 97, 12)), list(np.random.default_rng(8).integers(3, 97, 50))]
    outs, _ = engine.generate(prompts, sampling=SamplingParams(temperature=0.0), max_new_tokens=30)
    for prompt, out in zip(prompts, outs):
        cache = model.new_cache(1)
        logits, _, cache = _forward(model, cache, jnp.asarray([prompt], jnp.int32))
        want = []
        for _ in range(30):
            tok = int(jnp.argmax(logits[0, -1]))
            if tok in model.config.eos_token_ids:
                break
            want.append(tok)
            logits, _, cache = _forward(model, cache, jnp.asarray([[tok]], jnp.int32))
        assert out.token_ids[: len(want)] == want and len(want) > 0
    modes = {dict(key[2]).get("mode") for key in engine.steps.compiled.executables if key[0] in ("prefill", "decode")}
    assert modes == {"dense", "mixed", "sparse"}


# ---------------------------------------------------------------------------------------------- settings


def test_attention_mode_and_inactive_models():
    assert [attention_mode(32, lo, hi) for lo, hi in ((40, 50), (10, 31), (10, 32), (31, 40))] == [
        "sparse", "dense", "mixed", "mixed"]
    short = _model(max_length=24)  # never reaches dense_len 32: a plain dense model, no compressed caches
    assert not short.sparse_active and short.new_cache(1).k1 is None
    assert _model().sparse_active and _model().new_cache(1).k1.shape == (3, 1, 2, 64, 16)


def test_resolve_sparse_modes_overrides_and_errors():
    cfg = _config()
    assert resolve_sparse(cfg, "auto") == SMALL
    assert resolve_sparse(cfg, "off") is None
    plain = _config(None)
    assert resolve_sparse(plain, "auto") is None
    assert resolve_sparse(plain, "on") == SparseConfig()  # MiniCPM4 defaults
    got = resolve_sparse(cfg, "on", topk=7, window_size=32, dense_len=64)
    assert (got.topk, got.window_size, got.dense_len, got.num_selected) == (7, 32, 64, 11)
    with pytest.raises(MiniCPMError, match="kernel_size == 2"):
        resolve_sparse(cfg, SparseConfig(kernel_size=5, kernel_stride=2, block_size=8))
    with pytest.raises(MiniCPMError, match="topk must be >= 1"):
        resolve_sparse(cfg, "on", topk=0)
    with pytest.raises(MiniCPMError, match="sparse must be one of"):
        resolve_sparse(cfg, "sometimes")
    model = _model()
    with pytest.raises(MiniCPMError, match="new_cache"):
        model(_ids(4), KVCache.create(model.config, 1, MAX_LEN, jnp.float32))
