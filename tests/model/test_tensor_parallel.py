"""Tensor parallelism over JAX SPMD, on the eight CPU devices of tests/conftest.py.

The stored layout against a NumPy re-derivation; sizes that do not split a model; a model split over 2, 4
and 8 devices against the same weights on one device — fp32 logits of a batch prefill and greedy tokens,
batch 1 and 4 — dense, int4 (round-to-nearest and act-order), InfLLM-v2 sparse (a KV head's query group
spread over devices at 4 and 8) and EAGLE speculative; the collectives of one compiled decode step (and with a
peer-memory workspace, none of XLA's);
memory sizing and saving of a split model.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import DraftSpec, ModelConfig, SparseConfig
from minicpm_jax.engine import memory
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.paging import Paging
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.engine.speculative.engine import SpeculativeEngine
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model import causal_lm
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from minicpm_jax.model.layers import Int4Linear
from minicpm_jax.model.loading import convert_model, load_model, save_native, shard_model, weight_bytes
from minicpm_jax.model.parallel import QKV, GATE_UP, VOCAB, TensorParallel, from_layout, make_mesh, to_layout
from minicpm_jax.quant import QuantSpec
from pallas_kernels import matmul as matmul_mod
from pallas_kernels.peer_all_reduce import PeerWorkspace
from tests.helpers import SMALL, random_hf_weights, tiny_minicpm_config, write_checkpoint

# 8 query heads over 2 KV heads, head_dim 16, 128 MLP channels (whole int4 groups of 16 on 8 devices), a
# vocabulary of 97 (padded to 98, 100, 104), 2 layers (each size compiles its own programs).
CFG = tiny_minicpm_config(intermediate_size=128, num_hidden_layers=2)
CONFIG = ModelConfig.from_dict(CFG)
MAX_LEN = 64
PROMPTS = [list(range(3, 48)), [5, 17, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 4, [7]]
NEW_TOKENS = 12
# InfLLM-v2 with 16-token blocks, pages of a paged cache (SMALL's 8-token blocks are below the smallest page).
PAGED_SPARSE = SparseConfig(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=16, window_size=16, topk=2,
                            use_nope=False, dense_len=32)


def test_stored_layout_is_each_shards_heads_and_channels():
    tp = TensorParallel.of(CONFIG, 4)  # 2 KV heads on 4 devices: each KV head on 2
    h, kvh, d, i = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.intermediate_size
    assert (tp.q_heads, tp.kv_heads, tp.kv_copies, tp.stored_kv_heads, tp.vocab_padded) == (2, 1, 2, 4, 512)
    qkv = np.arange(3 * (h + 2 * kvh) * d, dtype=np.float32).reshape(3, -1)  # [in, q | k | v]
    q, k, v = np.split(qkv, [h * d, (h + kvh) * d], axis=1)
    stored = np.asarray(to_layout(tp, (None, QKV), jnp.asarray(qkv)))
    blocks = np.split(stored, 4, axis=1)
    for s, block in enumerate(blocks):
        heads = q[:, 2 * s * d : (2 * s + 2) * d]
        kv_head = s // 2  # query heads 2s, 2s+1 belong to KV head (2s) // (h / kvh)
        want = np.concatenate([heads, k[:, kv_head * d : (kv_head + 1) * d], v[:, kv_head * d : (kv_head + 1) * d]], 1)
        np.testing.assert_array_equal(block, want)
    np.testing.assert_array_equal(from_layout(tp, (None, QKV), stored), qkv)

    gate_up = np.arange(2 * 2 * i, dtype=np.float32).reshape(2, -1)
    stored = np.asarray(to_layout(tp, (None, GATE_UP), jnp.asarray(gate_up)))
    for s, block in enumerate(np.split(stored, 4, axis=1)):
        c = slice(s * i // 4, (s + 1) * i // 4)
        np.testing.assert_array_equal(block, np.concatenate([gate_up[:, :i][:, c], gate_up[:, i:][:, c]], 1))
    np.testing.assert_array_equal(from_layout(tp, (None, GATE_UP), stored), gate_up)

    table = np.ones((CONFIG.vocab_size, 3), np.float32)
    stored = np.asarray(to_layout(tp, (VOCAB, None), jnp.asarray(table)))
    assert stored.shape == (512, 3) and not stored[97:].any()  # each shard 128 rows (VOCAB_ALIGN)
    np.testing.assert_array_equal(from_layout(tp, (VOCAB, None), stored), table)
    # MiniCPM4's 73,448: 36,736 rows a shard at 2 (36,724 would leave lm_head's rows misaligned), itself at 1.
    assert [dataclasses.replace(tp, size=n, vocab_size=73448).vocab_padded for n in (1, 2, 4)] == [73448, 73472, 73728]


def test_sizes_that_do_not_split_the_model_are_refused():
    demo = ModelConfig.from_dict(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3))
    assert TensorParallel.valid_sizes(demo) == [1, 3]
    with pytest.raises(MiniCPMError, match="2 does not divide the 9 attention heads.*sizes that work for this model: 1, 3$"):
        TensorParallel.of(demo, 2)
    with pytest.raises(MiniCPMError, match="9 does not divide the MLP's 1536 channels"):
        TensorParallel.of(demo, 9)
    with pytest.raises(MiniCPMError, match="o_proj's 128 input rows split into 32 per device, not whole int4 scale groups of 64"):
        TensorParallel.of(CONFIG, 4, QuantSpec(group_size=64))
    TensorParallel.of(CONFIG, 4, QuantSpec(group_size=-1))  # per-channel scales are replicated
    with pytest.raises(MiniCPMError, match="over 16 devices, but 8 cpu device"):
        make_mesh(16)


# ------------------------------------------------------------------------------------- one device vs split
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("tp") / "ckpt"), CFG, random_hf_weights(CFG, seed=3))


def _act_order(model: MiniCPMForCausalLM) -> MiniCPMForCausalLM:
    """An act-order int4 model: random codes, random scales and a random permutation of each linear's rows."""
    rng = np.random.default_rng(0)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Int4Linear):
            module.perm.set_value(jnp.asarray(rng.permutation(module.in_features), jnp.int32))
            scales = rng.uniform(0.01, 0.03, module.scales.shape)
            module.scales.set_value(jnp.asarray(scales, module.scales.dtype))
    return model


def _sharp(model: MiniCPMForCausalLM, draft: EagleDraft):
    """Target and draft with a strong bigram path (embedding → lm_head) the draft knows, so speculative
    rounds accept several tokens (as tests/engine/test_speculative.py builds them)."""
    h = CONFIG.hidden_size
    model.model.embed_tokens.embedding.set_value(model.model.embed_tokens.embedding[...] * 60.0)
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * 60.0)
    draft.fc.kernel.set_value(jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], axis=0) * 4.0)
    for lin in (draft.self_attn.o_proj, draft.mlp.down_proj):
        lin.kernel.set_value(lin.kernel[...] * 0.05)


_MODELS: dict = {}


def _one_device(mode: str, ckpt: str):
    """(model, draft or None) on one device, built once per mode."""
    if mode not in _MODELS:
        sparse = PAGED_SPARSE if mode == "paged_sparse" else SMALL if "sparse" in mode else "off"
        draft = None
        if mode == "act_order":
            model = _act_order(MiniCPMForCausalLM(CONFIG, max_length=MAX_LEN, attention_impl="xla", dtype=jnp.float32,
                                                  rngs=nnx.Rngs(1), quant=QuantSpec(group_size=16, act_order=True),
                                                  sparse="off"))
        else:
            model = load_model(ckpt, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse=sparse,
                               quant="int4" if mode == "int4" else "auto", group_size=16)
        if mode.startswith("speculative"):
            draft = EagleDraft(DraftSpec.for_target(CONFIG, "minicpm"), max_length=MAX_LEN, attention_impl="xla",
                               dtype=jnp.float32, rngs=nnx.Rngs(2))
            _sharp(model, draft)
        _MODELS[mode] = model, draft
    return _MODELS[mode]


def _engine(model, draft, batch: int, mesh=None, paged: bool = False):
    if draft is None:
        # The paged pool: 16-token pages, scattered (each row's pages interleaved with the others').
        paging = Paging(num_pages=batch * -(-MAX_LEN // 16), page_size=16) if paged else None
        return Engine(model, batch_size=batch, chunk_length=32, decode_block=4, mesh=mesh, paging=paging)
    copy = nnx.merge(*nnx.split(draft))  # each engine replicates its own draft
    return SpeculativeEngine(model, copy, batch_size=batch, chunk_length=32, decode_block=2, mesh=mesh)


def _run(engine, prompts):
    """(fp32 last-token prefill logits, greedy tokens, speculative accept counts) of ``prompts``."""
    logits = np.asarray(engine.prefill(prompts))[: len(prompts)]
    engine.reset()
    results, stats = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    return logits, [r.token_ids for r in results], stats.spec_accepted


# 2 devices split the 2 KV heads; 4 and 8 copy them (the same layout, so 4 is left to the sparse tree case).
# Batch 1 and 4 at 2 and 4 devices; at 8 the ragged batch of 4 alone (its first row is the batch-1 prompt,
# the batch dimension is never split, and each batch size compiles its own SPMD programs).
CASES = [(m, n) for m in ("dense", "int4", "act_order", "sparse", "speculative", "paged") for n in (2, 8)]
CASES.append(("speculative_sparse", 4))  # tree nodes verified sparsely with a split query group
CASES.append(("paged_sparse", 2))  # InfLLM-v2 over pages: the compressed-key pools split by KV head too


_WANT: dict = {}


@pytest.mark.parametrize("mode,size", CASES)
def test_split_model_equals_one_device(mode, size, ckpt):
    model, draft = _one_device("dense" if mode == "paged" else mode, ckpt)
    mesh = None
    if mode == "dense":  # read straight into the mesh
        split = load_model(ckpt, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse="off",
                           mesh=make_mesh(size))
    elif mode.startswith("speculative"):  # the engine splits it
        split, mesh = model, make_mesh(size)
    else:
        split = shard_model(model, make_mesh(size))
    one = "dense" if mode == "paged" else mode  # the paged split is checked against the contiguous one device
    for batch, prompts in ((1, PROMPTS[:1]), (4, PROMPTS))[1 if size == 8 else 0:]:
        if (one, batch) not in _WANT:
            _WANT[one, batch] = _run(_engine(model, draft, batch), prompts)
        want_logits, want_tokens, want_accepted = _WANT[one, batch]
        engine = _engine(split, draft, batch, mesh, paged=mode.startswith("paged"))
        assert engine.model.tp.size == size
        got_logits, got_tokens, got_accepted = _run(engine, prompts)
        np.testing.assert_allclose(got_logits, want_logits, rtol=2e-5, atol=2e-5)
        assert got_tokens == want_tokens
        assert got_accepted == want_accepted
        if draft is not None:  # the rounds did accept drafted tokens
            assert sum(k * c for k, c in enumerate(got_accepted)) > sum(got_accepted)


def test_split_model_serves_one_slot_alone_and_logprobs(ckpt):
    """The server's step API on a split model: a prompt piece of one slot among several (run over that slot's
    cache rows alone) and decode blocks with log-probabilities, against one device."""
    def run(model):
        engine = Engine(model, batch_size=3, chunk_length=32, decode_block=4)
        engine.prefill_chunk([[], PROMPTS[2][:20], []], 32)  # one slot: its cache rows alone
        logits = engine.prefill_chunk([[], PROMPTS[2][20:], []], 32)
        ds = engine.decode_state([SamplingParams()] * 2, [6, 6], [[], []])
        ds = dataclasses.replace(ds, done=jnp.asarray([True, False, True]))
        ds, first = engine.first_token(ds, logits, ~ds.done, logprobs=3)
        engine.start(ds)
        ds, tokens, lps = engine.decode(ds, logprobs=3)
        assert [key for key in engine.steps.compiled.executables if key[0] == "prefill_rows"]
        return [np.asarray(x) for x in (logits, first[0], first[1], tokens, *lps)]

    model, _ = _one_device("dense", ckpt)
    for got, want in zip(run(shard_model(model, make_mesh(4))), run(model)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_split_model_runs_its_kernels_per_shard(ckpt, monkeypatch):
    """The Pallas kernels (interpret mode here) inside the SPMD program, InfLLM-v2's included, and the
    row-parallel linears' products as K-split parts (``matmul_parts``; a GPU's choice for one row, forced here
    at every row count)."""
    monkeypatch.setattr(matmul_mod, "default_splits", lambda rows, k: 2)
    one = load_model(ckpt, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="pallas", sparse=SMALL)
    split = shard_model(one, make_mesh(4))
    prompts = [PROMPTS[0], PROMPTS[2]]
    want_logits, want_tokens, _ = _run(_engine(one, None, 2), prompts)
    got_logits, got_tokens, _ = _run(_engine(split, None, 2), prompts)
    np.testing.assert_allclose(got_logits, want_logits, rtol=2e-5, atol=2e-5)
    assert got_tokens == want_tokens


# ------------------------------------------------------------------------------------------ collectives
def _collectives(model, mode: str) -> collections.Counter:
    """Collective instructions of the compiled program of one decode step."""
    engine = Engine(model, batch_size=1, chunk_length=32, decode_block=1)
    steps = engine.steps
    program = steps.compiled.jitted["decode"].lower(steps.state, engine.cache, engine.decode_state([], [], []),
                                                    mode=mode, sampling="auto")
    hlo = program.compile().as_text()
    return collections.Counter(re.findall(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                                          r"(?:-start)?\(", hlo))


def test_one_decode_step_has_the_designed_collectives(ckpt):
    layers = CONFIG.num_layers
    dense, _ = _one_device("dense", ckpt)
    # One all-reduce per row-parallel linear (o_proj, down_proj) and the embedding's, one gather of the logits.
    assert _collectives(shard_model(dense, make_mesh(2)), "dense") == {"all-reduce": 2 * layers + 1, "all-gather": 1}
    sparse, _ = _one_device("sparse", ckpt)
    assert _collectives(shard_model(sparse, make_mesh(2)), "sparse") == {"all-reduce": 2 * layers + 1, "all-gather": 1}
    # A KV head's query group on 2 devices: its selection queries are gathered once per layer.
    assert _collectives(shard_model(sparse, make_mesh(4)), "sparse") == {"all-reduce": 2 * layers + 1,
                                                                         "all-gather": 1 + layers}
    # Act-order rows read their input anywhere: o_proj and down_proj gather it first.
    act, _ = _one_device("act_order", ckpt)
    assert _collectives(shard_model(act, make_mesh(2)), "dense") == {"all-reduce": 2 * layers + 1,
                                                                     "all-gather": 1 + 2 * layers}
    # One device through the SPMD program: no collective at all.
    assert _collectives(shard_model(dense, make_mesh(1)), "dense") == {}


def test_with_a_peer_workspace_a_decode_step_has_no_xla_collective(ckpt, monkeypatch):
    """The pallas backend on a mesh with a peer-memory workspace (a made-up one: the step is lowered for CUDA
    here, not run; tests/model/test_gpu_tensor_parallel.py runs it): every collective of a decode step is the
    peer kernel (the blocks' all-reduces fused with the add and the norm, the embedding lookup's sum, the
    logits' gather as a sum), so nothing splits the step's CUDA graph."""
    monkeypatch.setattr(causal_lm, "peer_workspace", lambda mesh: PeerWorkspace((0x7F12_3456_7000, 0x7F98_7654_3000)))
    model = load_model(ckpt, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="pallas", sparse="off")
    engine = Engine(shard_model(model, make_mesh(2)), batch_size=1, chunk_length=32, decode_block=1)
    steps = engine.steps
    traced = steps.compiled.jitted["decode"].trace(steps.state, engine.cache, engine.decode_state([], [], []),
                                                   mode="dense", sampling="auto")
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert not re.findall(r"stablehlo\.(all_reduce|all_gather|all_to_all|collective_permute|reduce_scatter)", text)
    kernels = collections.Counter(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*name = "(peer_\w+)"', text))
    assert kernels == {"peer_all_reduce_add_norm": 2 * CONFIG.num_layers, "peer_all_reduce": 2}


def test_a_split_decode_step_computes_ropes_tables_once(ckpt):
    """Every layer rotates by the same cos/sin: the forward computes them once and hands them to each layer.
    Each layer's own became a kernel a layer under ``shard_map`` (its frequencies a separate loop operand)."""
    model = load_model(ckpt, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse="off")
    engine = Engine(shard_model(model, make_mesh(2)), batch_size=1, chunk_length=32, decode_block=1)
    steps = engine.steps
    traced = steps.compiled.jitted["decode"].trace(steps.state, engine.cache, engine.decode_state([], [], []),
                                                   mode="dense", sampling="auto")
    text = traced.lower().as_text()
    assert CONFIG.num_layers > 1 and len(re.findall(r"stablehlo\.cosine", text)) == 1


# ------------------------------------------------------------------------------------ memory and saving
def test_memory_plan_counts_each_devices_share(ckpt):
    sizing = dict(max_length=1024, batch_size=2, dtype=jnp.bfloat16, sparse=None, weights=0, budget=1 << 40,
                  chunk_length=256)
    whole = KVCache.nbytes(CONFIG, 2, 1024, jnp.bfloat16)
    assert memory.plan(CONFIG, **sizing).cache == whole
    assert memory.plan(CONFIG, tensor_parallel=2, **sizing).cache == whole // 2
    assert memory.plan(CONFIG, tensor_parallel=8, **sizing).cache == whole // 2  # 2 KV heads, each on 4 devices
    one = weight_bytes(ckpt, dtype=jnp.float32)
    two = weight_bytes(ckpt, dtype=jnp.float32, tensor_parallel=2)
    norms = 4 * CONFIG.hidden_size * (2 * CONFIG.num_layers + 1)  # replicated
    pad = TensorParallel.of(CONFIG, 2).vocab_padded - CONFIG.vocab_size  # 97 rows padded to 256 (128 a device)
    assert two == (one - norms) // 2 + norms + pad * 4 * CONFIG.hidden_size  # embedding's + lm_head's pad rows, halved


def test_engine_refuses_a_model_split_over_another_mesh(ckpt):
    split = shard_model(_one_device("dense", ckpt)[0], make_mesh(2))
    with pytest.raises(MiniCPMError, match="already split over another mesh"):
        Engine(split, mesh=make_mesh(4))
    with pytest.raises(MiniCPMError, match="already split over a mesh"):
        shard_model(split, make_mesh(4))


def test_split_model_saves_and_converts_as_one_device(ckpt, tmp_path):
    one = load_model(ckpt, dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse="off")
    split = shard_model(one, make_mesh(4))
    save_native(split, str(tmp_path))
    back = load_model(str(tmp_path), dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse="off")
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(one)), nnx.to_flat_state(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    # A native checkpoint read straight into a mesh: the same arrays as splitting the one-device model.
    native = load_model(str(tmp_path), dtype=jnp.float32, max_length=MAX_LEN, attention_impl="xla", sparse="off",
                        mesh=make_mesh(4))
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(split)), nnx.to_flat_state(nnx.state(native))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
        assert a[...].sharding.spec == b[...].sharding.spec
    # int4 at load time on a split model: the same codes as converting on one device, in the stored layout.
    quantized = convert_model(split, QuantSpec(group_size=16))
    want = convert_model(one, QuantSpec(group_size=16))
    tp = quantized.tp
    layer, ref = quantized.model.layers[1].self_attn.qkv_proj, want.model.layers[1].self_attn.qkv_proj
    np.testing.assert_array_equal(from_layout(tp, (None, QKV), layer.qweight[...]), np.asarray(ref.qweight[...]))
    assert layer.qweight[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
