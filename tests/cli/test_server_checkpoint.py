"""The server on a checkpoint that brings its own serving settings, as published MiniCPM4.1 directories do:
sampling defaults from ``generation_config.json`` (for requests that give none, as vLLM does), a chat
template with MiniCPM4.1's ``enable_thinking`` switch reached through ``chat_template_kwargs``, and the
README's curl example run as written (its port aside) against it. This server keeps the contiguous KV cache
(``--kv_cache contiguous``; the other server tests run the default paged one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import httpx
import pytest

from tests.helpers import Server

pytestmark = pytest.mark.smollm2
README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
THINK_OFF = "<think>\n\n</think>\n\n"  # what MiniCPM4.1's template appends when enable_thinking is false


@pytest.fixture(scope="module")
def checkpoint(smollm2_2_layers_dir, tmp_path_factory):
    """The demo model with a thinking switch in its template and greedy recommended sampling; cut to two
    layers (its tokenizer, template and shapes): the claims are the server's settings, not the answers."""
    path = str(tmp_path_factory.mktemp("published") / "smollm2-thinking")
    shutil.copytree(smollm2_2_layers_dir, path)
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    template = tok_cfg.get("chat_template") or open(os.path.join(path, "chat_template.jinja"), encoding="utf-8").read()
    template += ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                 + THINK_OFF + "{% endif %}")
    if os.path.exists(os.path.join(path, "chat_template.jinja")):  # it would take precedence
        os.remove(os.path.join(path, "chat_template.jinja"))
    tok_cfg["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": 2, "temperature": 0.0, "top_p": 0.5, "top_k": 0, "do_sample": True}, f)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    # The contiguous cache (--kv_cache contiguous): the other server tests run the default, paged one.
    s = Server("--model_path", checkpoint, "--api_key", "sk-local", "--max_batch_size", "2", "--max_length", "512",
               "--kv_cache", "contiguous", "--nowarm_up")
    yield s
    s.stop()


def _chat(server, **body):
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 12, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-local"},
                   timeout=300)
    return r.status_code, r.json()


def test_requests_without_sampling_fields_take_the_checkpoint_defaults(server):
    """generation_config.json says temperature 0: requests that give none decode greedily whatever their
    seed; one that sets temperature samples (OpenAI's default would have sampled at 1.0 throughout)."""
    _, greedy = _chat(server, temperature=0)
    texts = {_chat(server, seed=seed)[1]["choices"][0]["message"]["content"] for seed in (1, 2, 3)}
    assert texts == {greedy["choices"][0]["message"]["content"]}
    sampled = {_chat(server, seed=seed, temperature=1.5, top_p=1.0)[1]["choices"][0]["message"]["content"]
               for seed in (1, 2, 3)}
    assert len(sampled) > 1
    kv = httpx.get(server.url + "/health").json()["kv_cache"]
    assert kv == {"kind": "contiguous", "slots": 2, "max_length": 512}


def test_enable_thinking_reaches_the_chat_template(server, checkpoint):
    from minicpm_jax.tokenizer import load_tokenizer

    extra = len(load_tokenizer(checkpoint)(THINK_OFF, add_special_tokens=False)["input_ids"])
    base = _chat(server, temperature=0)[1]["usage"]["prompt_tokens"]
    status, off = _chat(server, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert status == 200 and off["usage"]["prompt_tokens"] == base + extra
    assert _chat(server, temperature=0, enable_thinking=False)[1]["usage"]["prompt_tokens"] == base + extra
    assert _chat(server, temperature=0, chat_template_kwargs={"enable_thinking": True})[1]["usage"]["prompt_tokens"] == base
    status, err = _chat(server, chat_template_kwargs={"tokenize": False})
    assert status == 400 and "reserved" in err["error"]["message"] and err["error"]["param"] == "chat_template_kwargs"


def test_readme_curl_example_runs_as_written(server):
    """The README's curl command, its port replaced by this server's: a chat completion with text."""
    with open(README, encoding="utf-8") as f:
        block = re.search(r"```bash\n(python -m minicpm_jax\.server[^\n]*)\n(curl .*?)\n```", f.read(), re.S)
    assert block and "--api_key sk-local" in block.group(1)
    command = block.group(2).replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    r = subprocess.run(["bash", "-c", command + " --silent --show-error"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"].strip()
    assert 0 < answer["usage"]["completion_tokens"] <= 32
