"""The kernel-backend switch (``pallas_kernels.backend``): every backend namespace offers the same ops with
the reference's signature, names resolve as documented, and the model runs every op through the one it
was built with."""

from __future__ import annotations

import inspect
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.quant import QuantSpec
from pallas_kernels import backend, triton, xla
from tests.helpers import tiny_minicpm_config


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", backend.BACKENDS)
def test_every_backend_offers_the_same_ops(name):
    """Identical names: the namespace's public callables are exactly ``backend.OPS``."""
    ns = backend.get(name)
    assert sorted(ns.__all__) == sorted(backend.OPS)
    assert all(callable(getattr(ns, op)) for op in backend.OPS)


@pytest.mark.parametrize("op", backend.OPS)
def test_pallas_ops_take_the_reference_signature(op):
    """Every Pallas op takes the reference's parameters, in order, plus only keyword-only launch
    overrides with defaults (config, splits, interpret ...)."""
    ref, ker = getattr(xla, op), getattr(triton, op)
    ref_params, ker_params = _params(ref), _params(ker)
    assert ker_params[: len(ref_params)] == ref_params, (op, ref_params, ker_params)
    extra = list(inspect.signature(ker).parameters.values())[len(ref_params):]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty for p in extra)


def test_names_resolve_as_documented():
    assert backend.resolve("auto", 64) == "xla"  # no GPU here
    assert backend.resolve("pallas", 64) == "pallas" and backend.resolve("xla", 48) == "xla"
    assert backend.interprets("pallas") and not backend.interprets("xla")  # the CLI warns of the first
    with pytest.raises(backend.UnknownBackend, match="'cuda' is not available"):
        backend.resolve("cuda", 64)
    with pytest.raises(backend.UnsupportedShape, match="power-of-2 head_dim"):
        backend.resolve("pallas", 48)
    config = ModelConfig.from_dict(tiny_minicpm_config(head_dim=12))
    with pytest.raises(MiniCPMError, match="attention_impl 'pallas' needs a power-of-2 head_dim >= 16"):
        MiniCPMForCausalLM(config, attention_impl="pallas")


def test_the_model_runs_every_op_through_its_backend(monkeypatch):
    """An int4 model built with ``xla`` calls the xla namespace's attention, RoPE + KV writer and int4 matmul
    (counted by wrapping them); the pallas namespace is never touched."""
    calls = {}
    for ns in (xla, triton):
        for op in ("attention", "rope_write", "int4_matmul"):
            fn = getattr(ns, op)

            def counted(*a, _fn=fn, _key=(ns.__name__, op), **k):
                calls[_key] = calls.get(_key, 0) + 1
                return _fn(*a, **k)

            monkeypatch.setattr(ns, op, counted)
    config = ModelConfig.from_dict(tiny_minicpm_config())
    model = MiniCPMForCausalLM(config, max_length=32, attention_impl="xla", dtype=jnp.float32, rngs=nnx.Rngs(0),
                               quant=QuantSpec(group_size=32))
    logits, _, _ = model(jnp.asarray([[1, 2, 3]]), model.new_cache(1))
    assert np.isfinite(np.asarray(logits)).all()
    layers = config.num_layers
    assert calls == {("pallas_kernels.xla", "attention"): layers, ("pallas_kernels.xla", "rope_write"): layers,
                     ("pallas_kernels.xla", "int4_matmul"): 4 * layers}


@pytest.mark.parametrize("devices", [1, 4])
def test_residual_ops_reduce_partial_sums_then_add_and_normalise(devices):
    """The block-boundary ops (``pallas_kernels.residual``): fp32 partial sums of ``devices`` shards summed
    over the mesh axis, rounded to the residual's bf16, scaled, added; then the RMSNorm of the sum —
    against a NumPy re-derivation (at one device: no axis, the partial is the whole output)."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    if len(jax.devices()) < devices:  # the CPU has 8 (tests/conftest.py); a 2-GPU machine has 2
        pytest.skip(f"needs {devices} devices of the default backend")
    rng = np.random.default_rng(3)
    parts = rng.standard_normal((devices, 2, 3, 64)).astype(np.float32)
    residual = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.bfloat16)
    scale, eps = 0.7, 1e-5
    for ns in (xla, triton):
        if devices == 1:
            h, normed = ns.residual_add_norm(jnp.asarray(parts[0]), residual, scale, weight, eps=eps)
            h2 = ns.residual_add(jnp.asarray(parts[0]), residual, scale)
        else:
            mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))
            run = lambda p, r, w: (*ns.residual_add_norm(p[0], r, scale, w, eps=eps, axis_name="tp"),  # noqa: E731
                                   ns.residual_add(p[0], r, scale, axis_name="tp"))
            h, normed, h2 = jax.shard_map(run, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P(),
                                          check_vma=False)(jnp.asarray(parts), residual, weight)
        r = np.asarray(residual, np.float32)
        added = r + np.asarray(jnp.asarray(parts.sum(0)).astype(jnp.bfloat16), np.float32) * np.float32(
            np.asarray(jnp.asarray(scale, jnp.bfloat16), np.float32))
        np.testing.assert_allclose(np.asarray(h, np.float32), added, rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
        hf = np.asarray(h, np.float32)
        want = hf / np.sqrt(np.mean(hf * hf, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float32)
        np.testing.assert_allclose(np.asarray(normed, np.float32), want, rtol=2e-2, atol=2e-2)
        assert h.dtype == normed.dtype == jnp.bfloat16


def test_a_wide_message_is_reduced_in_the_residuals_dtype():
    """A message of more than ``WIDE_MESSAGE`` elements (a prefill chunk's) is rounded to the residual's bf16
    on each device and summed in bf16, in both backends; one at the limit is summed in fp32. NumPy
    re-derivation at 2 devices, where a bf16 sum of two bf16 values is the rounded fp32 sum."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    from pallas_kernels.residual import WIDE_MESSAGE

    width = 256
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    rng = np.random.default_rng(5)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float32)  # noqa: E731
    for rows, wide in ((WIDE_MESSAGE // width, False), (WIDE_MESSAGE // width + 1, True)):
        parts = (rng.standard_normal((2, rows, width)) * 3).astype(np.float32)
        residual = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
        total = bf16(bf16(parts[0]) + bf16(parts[1])) if wide else bf16(parts.sum(0))
        want = np.asarray(xla.residual_add(jnp.asarray(total), residual, 1.0))  # the scale keeps the sum
        for ns in (xla, triton):
            run = lambda p, r: ns.residual_add(p[0], r, 1.0, axis_name="tp")  # noqa: E731
            split = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(), check_vma=False))
            got = split(jnp.asarray(parts), residual)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{ns.__name__}, {rows} rows")
            # What is sent: the program's all-reduce takes a bf16 message when wide, fp32 otherwise.
            text = split.lower(jnp.asarray(parts), residual).as_text()
            sent = re.findall(r"stablehlo\.all_reduce.*?\}\) : \(tensor<[0-9x]+x(\w+)>\)", text, re.S)
            assert sent[:1] == ["bf16" if wide else "f32"], (ns.__name__, rows, sent)
        # The two roundings are visible: the fp32 sum, rounded once, differs somewhere.
        assert (bf16(bf16(parts[0]) + bf16(parts[1])) != bf16(parts.sum(0))).any()
