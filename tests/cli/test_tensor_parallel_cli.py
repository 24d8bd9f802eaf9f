"""``--tensor_parallel`` as a user runs it (the CPU devices of tests/conftest.py stand for GPUs): the demo
model over the sizes its 9 heads allow and refusing the others, one model split over two processes
through ``jax.distributed`` (gloo collectives between them), perplexity and the server of a split model,
each against one process on one device."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import httpx
import pytest

from tests.helpers import Server, random_hf_weights, write_checkpoint

RUN = [sys.executable, "-m", "minicpm_jax.run"]
PROMPT = ["--prompt_text", "Name three colours.", "--num_generate", "10", "--json_output", "--seed", "0"]


def _run(*args, env=None, timeout=600):
    return subprocess.run(RUN + list(args), capture_output=True, text=True, timeout=timeout, env=env or os.environ)


@pytest.mark.smollm2
def test_demo_model_splits_over_three_devices_and_refuses_two(smollm2_dir, smollm2_2_layers_dir):
    """The refusals on the demo model itself; the split's tokens against one device on the demo model cut to
    two layers (its 9 query and 3 KV heads, MLP width and vocabulary split the same way; every layer is
    split alike, so two layers prove what 30 do, at a fifteenth of the compile time)."""
    r = _run("--tensor_parallel", "2", *PROMPT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: tensor parallelism over 2 devices: 2 does not divide the 9 attention heads; sizes that work for this "
        "model: 1, 3")
    # --tp_all_reduce nccl reaches XLA's flags (a GPU setting: harmless on these CPU devices)
    cut = ("--model_path", smollm2_2_layers_dir, "--ignore_eos", *PROMPT)
    one, three = _run(*cut), _run("--tensor_parallel", "3", "--tp_all_reduce", "nccl", *cut)
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    assert len(json.loads(one.stdout)["token_ids"]) == 10
    assert json.loads(three.stdout)["token_ids"] == json.loads(one.stdout)["token_ids"]
    r = _run("--tensor_parallel", "16", *PROMPT)
    assert r.returncode == 2 and "over 16 devices, but 8 cpu device(s) are visible" in r.stderr
    r = _run("--tensor_parallel", "3", "--tp_all_reduce", "peer", *PROMPT)  # peer memory is a GPU's
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: --tp_all_reduce peer: the peer-memory all-reduce needs every device of the mesh to be a GPU of this "
        "process")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def small_llama(smollm2_dir, tmp_path_factory):
    """A small random Llama checkpoint (4 query heads, 2 KV heads) with the demo model's tokenizer."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)
    path = write_checkpoint(str(tmp_path_factory.mktemp("llama") / "ckpt"), cfg, random_hf_weights(cfg, seed=5, std=0.3))
    for name in os.listdir(smollm2_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    return path


@pytest.mark.smollm2
def test_one_model_over_two_processes(small_llama):
    """Two processes of two CPU devices each run one model split four ways: process 0 prints what one
    process on one device prints, process 1 nothing; both exit 0."""
    args = ["--model_path", small_llama, "--max_length", "128", "--use_chat_template=false", *PROMPT]
    want = _run(*args)
    assert want.returncode == 0, want.stderr
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen(RUN + args + ["--tensor_parallel", "4", "--num_processes", "2", "--process_id", str(i),
                                            "--coordinator_address", f"127.0.0.1:{port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1] + outs[1][1]
    # gloo (the CPU's collectives) prints its "[Gloo] Rank i is connected" lines on stdout itself.
    printed = [[line for line in out.splitlines() if not line.startswith("[Gloo]")] for out, _ in outs]
    got = json.loads(printed[0][-1])
    assert got["token_ids"] == json.loads(want.stdout)["token_ids"] and got["text"] == json.loads(want.stdout)["text"]
    assert printed[1] == []


@pytest.mark.smollm2
def test_perplexity_of_a_split_model(small_llama, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    cmd = [sys.executable, "-m", "minicpm_jax.perplexity", "--model_path", small_llama, "--text_file", str(text),
           "--max_length", "64", "--chunk_length", "32"]
    one = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    two = subprocess.run(cmd + ["--tensor_parallel", "2"], capture_output=True, text=True, timeout=600)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    value = lambda r: float(r.stdout.split()[1])  # noqa: E731
    assert abs(value(two) - value(one)) < 1e-4 * value(one)


@pytest.mark.smollm2
def test_server_of_a_split_model(small_llama):
    """The server over two devices answers as one process on one device does (greedy)."""
    body = {"prompt": "Name three colours.", "max_tokens": 8, "temperature": 0}
    texts = []
    for flags in ((), ("--tensor_parallel", "2")):
        server = Server("--model_path", small_llama, "--max_length", "128", "--max_batch_size", "2", "--nowarm_up",
                        *flags)
        try:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        finally:
            server.stop()
    assert texts[1] == texts[0] and texts[0]
