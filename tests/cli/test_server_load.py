"""The server under load (issue 28), live on 127.0.0.1 with the demo model, driven by the load generator of
``benchmarks.serve``: TTFT among 8 busy clients against one client alone, streams that keep flowing while a
long prompt is read, and 32 clients (some dropping mid-stream, some abandoning non-streaming calls) ended
by SIGTERM. About 2.5 minutes on the 2-core CPU, one server for all three."""

from __future__ import annotations

import re
import statistics

import pytest

from benchmarks.serve import Client, Mix, run_interference, run_level
from tests.helpers import Server

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = Server("--max_batch_size", "8", "--max_length", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = Client(server.url)
    c.calibrate()
    return c


def _server_ttfts(server, ids: list[str]) -> list[float]:
    """The ttft= of the access lines of the requests ``ids`` (the log is written once a response ends)."""
    import time

    deadline = time.time() + 10
    while True:
        server.log.seek(0)
        found = dict(re.findall(r" 200 (\S+) prompt_tokens=.* ttft=([0-9.]+)s", server.log.read()))
        if all(i in found for i in ids) or time.time() > deadline:
            return [float(found[i]) for i in ids]
        time.sleep(0.1)


def test_ttft_among_8_busy_clients_is_close_to_one_client_alone(server, client):
    """Admission at every decode step and a prompt read in one piece: a request that arrives while 7
    others decode waits at most one step for its prefill (it waited for a 16-step decode block and for
    every other newcomer's whole prompt: 2.9x the single-client TTFT). TTFT as the server logs it (arrival
    to first token; the clients' own threads, 8 against 1, are not in it). Three rounds, each one client
    alone then 8 busy clients; a round's ratio compares two levels measured under the same machine load,
    and the median round is asserted (on a shared 2-core machine one round's alone TTFT doubled from the
    next one's). The 8 clients start spread over the time a request takes among 8 (measured first, not
    counted), so they arrive as independent users do: a paged server decodes one row faster than eight,
    and a spread over one client's time would send them in bursts, where each newcomer also waits for the
    others' prompts (one 64-token piece a step on a CPU)."""
    client.stream(client.prompt(40, 1), 48)  # compiled
    mix = Mix.fixed(40, 48)
    busy_e2e = run_level(client, 8, 8, mix)["e2e_p50_s"]
    rounds = []
    for _ in range(3):
        alone = run_level(client, 1, 4, mix)
        busy = run_level(client, 8, 12, mix, spread_s=busy_e2e)
        assert alone["completed"] == 4 and busy["completed"] == 12, (alone["errors"], busy["errors"])
        one = statistics.median(_server_ttfts(server, alone["ids"]))
        eight = statistics.median(_server_ttfts(server, busy["ids"]))
        rounds.append((one, eight, eight / one, alone["ttft_p50_s"], busy["ttft_p50_s"]))
    ratio = statistics.median(r[2] for r in rounds)
    print("\nTTFT p50 (server side) per round, 1 client / 8 clients / ratio (client side 1 / 8): "
          + "; ".join(f"{a:.3f} / {b:.3f} / {c:.2f}x ({d:.3f} / {e:.3f})" for a, b, c, d, e in rounds)
          + f"; median ratio {ratio:.2f}x")
    assert ratio <= 1.5


def test_streams_keep_flowing_while_a_long_prompt_is_read(client):
    """7 streams decode when a 450-token prompt arrives: it is read 64 tokens a step between their decode
    steps, so their longest gap stays within 3x their median gap (it was one stall of the whole prefill:
    9x), and its answer equals the same prompt's alone. The median is over the streams' gaps from their
    fourth chunk to the prompt's answer, most of them while it is read (each then a decode step plus a
    piece); against the steady gaps before it arrived the ratio is about 2.7 on the 2-core CPU (printed)."""
    r = run_interference(client, 7, 450, prompt_tokens=24, max_tokens=400, warm_chunks=4)
    assert not r["long_prompt_error"] and not r["stream_errors"], r
    print(f"\n7 streams + a {r['long_prompt_tokens']}-token prompt: gaps median {r['median_gap_s']:.3f} s (steady "
          f"{r['steady_median_gap_s']:.3f} s, while it is read {r['window_median_gap_s']:.3f} s), longest "
          f"{r['max_gap_s']:.3f} s ({r['max_over_median']:.2f}x the median, {r['max_over_steady_median']:.2f}x the "
          f"steady one); its TTFT {r['long_prompt_ttft_s']:.2f} s")
    assert r["long_prompt_tokens"] >= 400 and all(s["gaps"] >= 5 for s in r["per_stream"])
    assert r["max_over_median"] <= 3
    alone = client.stream(client.prompt(450, 99_999), 4)
    assert r["long_prompt_text"] and r["long_prompt_text"] == alone["text"]


def _chat_body(prompt: str, max_tokens: int, stream: bool, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}


def _stream(url: str, body: dict, drop_after: int | None = None) -> tuple[str, list]:
    """(text, the data payloads) of a streaming chat request; the client leaves after ``drop_after`` text
    chunks when given."""
    import json

    import httpx

    text, events = "", []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if isinstance(events[-1], dict) and events[-1].get("choices"):
                text += events[-1]["choices"][0]["delta"].get("content") or ""
                if drop_after is not None and sum(1 for e in events if isinstance(e, dict)) > drop_after:
                    break
    return text, events


def test_32_clients_dropping_abandoning_then_sigterm(server):
    """32 clients at once: 20 complete (16 streaming, 4 not), 4 drop their stream after two chunks, 4
    abandon a non-streaming call, 4 long streams are still running at SIGTERM. Every completed answer is
    the prompt's answer alone, the 8 dropped requests are cancelled, every stream still open ends with
    [DONE], and the server exits 0. (Last in this module: it stops the shared server.)"""
    import concurrent.futures
    import signal
    import time

    import httpx

    prompts = [f"Give me one word about the number {i}." for i in range(8)]
    alone = [_stream(server.url, _chat_body(p, 12, True))[0] for p in prompts]
    before = httpx.get(server.url + "/health").json()["finished"].get("cancelled", 0)

    def complete_stream(i):
        return _stream(server.url, _chat_body(prompts[i % 8], 12, True))[0]

    def complete_plain(i):
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(prompts[i % 8], 12, False), timeout=120)
        return r.json()["choices"][0]["message"]["content"]

    def drop(i):
        return _stream(server.url, _chat_body(prompts[i % 8], 200, True, ignore_eos=True), drop_after=2)

    def abandon(i):
        try:
            httpx.post(server.url + "/v1/chat/completions", timeout=2,
                       json=_chat_body(prompts[i % 8], 200, False, ignore_eos=True))
        except httpx.TimeoutException:
            return "abandoned"
        return "answered"

    def long_stream(i):
        return _stream(server.url, _chat_body(prompts[i % 8], 120, True, ignore_eos=True))

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        kinds = [complete_stream] * 16 + [complete_plain] * 4 + [drop] * 4 + [abandon] * 4 + [long_stream] * 4
        futures = [pool.submit(fn, i) for i, fn in enumerate(kinds)]
        finished = [f.result() for f in futures[:28]]  # all but the long streams
        deadline = time.time() + 60
        while httpx.get(server.url + "/health").json()["finished"].get("cancelled", 0) < before + 8:
            assert time.time() < deadline, httpx.get(server.url + "/health").json()
            time.sleep(0.1)
        health = httpx.get(server.url + "/health").json()
        assert health["active"] + health["queued"] == 4  # only the long streams are left
        server.proc.send_signal(signal.SIGTERM)
        longs = [f.result() for f in futures[28:]]
    assert server.proc.wait(60) == 0, server.output()
    print(f"\n32 clients, SIGTERM with 4 streams running: {time.perf_counter() - t0:.1f} s")
    assert finished[:20] == [alone[i % 8] for i in range(20)]
    assert [len(events) >= 2 and events[-1] != "[DONE]" for _, events in finished[20:24]] == [True] * 4
    assert finished[24:28] == ["abandoned"] * 4
    assert health["finished"]["cancelled"] == before + 8
    for _, events in longs:  # finished within the grace period, or ended by it: [DONE] either way
        assert events[-1] == "[DONE]" and ("error" in events[-2] or events[-2]["choices"][0]["finish_reason"])
    server.log.seek(0)
    assert server.log.read().count(" 499 chatcmpl-") == 4  # the abandoned calls' access lines
