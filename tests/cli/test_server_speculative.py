"""Speculative decoding behind the API (issue 28, item 8): the server with ``--draft_path`` (a random EAGLE
draft for the demo model) gives the plain greedy answers, streamed and not, several requests at once, and
``/health`` reports the mean accept length; log-probabilities are refused with a draft. On the demo model cut
to two layers (its heads, vocabulary, tokenizer and chat template): losslessness holds for any target, so
the claim does not need the answers' quality, and two layers compile and decode far faster than 30."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.helpers import Server

pytestmark = pytest.mark.smollm2
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count from 1 to 10.", "Say hello."]


@pytest.fixture(scope="module")
def draft_dir(smollm2_2_layers_dir, tmp_path_factory):
    import jax.numpy as jnp
    from flax import nnx

    from minicpm_jax.config import DraftSpec, ModelConfig
    from minicpm_jax.model.draft import EagleDraft
    from minicpm_jax.model.loading import save_draft

    cfg = ModelConfig.from_pretrained(smollm2_2_layers_dir)
    draft = EagleDraft(DraftSpec.for_target(cfg), max_length=256, attention_impl="xla", dtype=jnp.float32,
                       rngs=nnx.Rngs(0))
    path = str(tmp_path_factory.mktemp("draft") / "draft")
    save_draft(draft, path)
    return path


@pytest.fixture(scope="module")
def plain_answers(smollm2_2_layers_dir):
    """The plain greedy answers, from the engine in this process."""
    import jax.numpy as jnp

    from minicpm_jax.engine.engine import Engine
    from minicpm_jax.model.loading import load_model
    from minicpm_jax.tokenizer import TextStream, encode_prompt, load_tokenizer, stop_token_ids

    path = smollm2_2_layers_dir
    tok = load_tokenizer(path)
    # The server's dtype on a CPU (--dtype auto): in bf16 "Say hello." takes another branch at a near tie.
    model = load_model(path, max_length=256, attention_impl="xla", dtype=jnp.float32)
    engine = Engine(model, batch_size=1, chunk_length=64)
    out = []
    for q in QUESTIONS:
        ids = encode_prompt(tok, messages=[{"role": "user", "content": q}])
        (res,), _ = engine.generate([ids], max_new_tokens=20, stop_token_ids=stop_token_ids(model.config, tok, path))
        text = TextStream(tok, [])
        text.push(res.token_ids)
        out.append(text.finish())
    return out


def _ask(url: str, question: str, **extra):
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 20, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


def _ask_stream(url: str, question: str) -> str:
    import json

    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 20, "temperature": 0, "stream": True}
    text, done = "", False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for c in json.loads(line[6:]).get("choices", []):
                    text += c["delta"].get("content") or ""
    assert done
    return text


def test_speculative_server_gives_the_plain_greedy_answers(smollm2_2_layers_dir, draft_dir, plain_answers):
    server = Server("--model_path", smollm2_2_layers_dir, "--max_batch_size", "3", "--max_length", "256",
                    "--draft_path", draft_dir, "--spec_num_iter", "3", "--spec_tree_size", "16", "--nowarm_up")
    try:
        assert "speculative llama EAGLE draft, tree 16 (3 steps x top-10)" in server.output()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 4 requests on 3 slots: joins and a queue
            answers = list(pool.map(lambda q: _ask(server.url, q), QUESTIONS))
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        assert [r.json()["choices"][0]["message"]["content"] for r in answers] == plain_answers
        assert _ask_stream(server.url, QUESTIONS[0]) == plain_answers[0]
        health = httpx.get(server.url + "/health").json()
        print(f"\n/health: {health}")
        assert health["speculative"] and health["spec_rounds"] >= 20
        assert 1.0 <= health["spec_mean_accept_length"] <= 4.0
        r = _ask(server.url, QUESTIONS[0], logprobs=True)
        assert r.status_code == 400 and "speculative" in r.json()["error"]["message"]
    finally:
        server.stop()
