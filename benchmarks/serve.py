"""Serving load generator: ``python -m benchmarks.serve`` drives an OpenAI-compatible server (ours, started
here, or any at ``--url``) with streaming completions and writes JSON.

Two scenarios, each per server configuration (``--server NAME=FLAGS``, repeatable: e.g. one plain and one
with ``--draft_path``):

* ``load`` — closed-loop clients at each of ``--concurrency`` (1, 8, 32): each client sends its next
  request when the last has ended, ``--requests`` in all per level (after two warm-up requests); the
  clients' first requests are spread over the second warm-up request's latency (users arrive
  independently, not in one synchronised wave, whose last prompt waits for all the others'). Prompts of
  about ``--prompt_tokens`` tokens, outputs of ``--max_tokens`` (each request a deterministic draw between
  half of it and all of it, so clients do not stay in lock-step), ``ignore_eos`` so every request runs
  its length. A realistic mix instead: ``--prompt_range 200,4000 --output_range 100,500
  --shared_prefix_tokens 2000 --shared_fraction 0.5`` (half the requests start with one 2,000-token system
  prompt). Reported: output tokens/s and requests/s over the level's wall time; TTFT (send → first
  text chunk) and ITL (gap between text chunks, divided by the tokens that chunk carried) p50 / p99; the
  share of prompt tokens the server found cached (``usage.prompt_tokens_details.cached_tokens``) and TTFT
  p50 of the requests with and without the shared prefix; from ``/health`` (polled while the level runs)
  a paged server's peak KV pages in use, prefix-cache hit rate and preemptions, and the speculative mean
  accept length when it reports one.
* ``prefix`` — one request at a time: a new ``--prefix_prompt_tokens`` prompt (a miss), then the same prompt
  with another ending (a hit), ``--prefix_pairs`` times; TTFT p50 of hits and misses and their ratio.
* ``interference`` — ``--streams`` streams decode; once each has streamed 8 chunks, one prompt of
  ``--long_prompt_tokens`` tokens arrives. Reported: the streams' gaps between chunks before it arrived
  (the steady rhythm) and from then until the long prompt's first token (plus a few chunks), the median
  over both, the longest while it was read, their ratio (issue 28 asks ≤ 3: a prefill interleaved with
  decoding, not a stall; also against the steady median alone), and the long prompt's TTFT.

Imported by nothing in the library. Needs only ``httpx`` (a dependency of the package's test extra).
Example on a CPU with the demo model (tiny settings; tests/bench/test_serve.py runs this)::

    python -m benchmarks.serve --server "demo=--max_batch_size 4 --max_length 512" --concurrency 1,4 \
        --requests 4 --prompt_tokens 32 --max_tokens 8 --out /tmp/serve.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation), None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


class ServerProcess:
    """``python -m minicpm_jax.server FLAGS`` on a free port, ready once ``/health`` answers."""

    def __init__(self, flags: list[str], log_path: str, timeout_s: float = 900):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "minicpm_jax.server", "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not start in {timeout_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Client:
    """Streaming completions against ``url`` (OpenAI API; ``api_key`` if the server wants one).

    Each client thread keeps one ``httpx.Client`` and its keep-alive connection, as an SDK client does:
    building a client costs ~25 ms of CPU (its TLS context), which a TTFT measured per request would
    otherwise count as the server's."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.words_per_token = 1.0
        self._local = threading.local()

    @property
    def http(self) -> httpx.Client:
        """This thread's HTTP client (made on first use)."""
        if getattr(self._local, "client", None) is None:
            self._local.client = httpx.Client(timeout=3600)
        return self._local.client

    def calibrate(self) -> None:
        """Words of :data:`WORDS` per prompt token of this server's tokenizer (prompt_tokens of a probe)."""
        n = 48
        r = self.http.post(self.url + "/v1/completions", headers=self.headers, timeout=600,
                           json=self._body(self.prompt_words(n, 0), 1, stream=False))
        r.raise_for_status()
        self.words_per_token = n / r.json()["usage"]["prompt_tokens"]

    def prompt_words(self, n: int, seed: int) -> str:
        return f"Request {seed}: " + " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))

    def prompt(self, tokens: int, seed: int) -> str:
        return self.prompt_words(max(1, round(tokens * self.words_per_token) - 3), seed)

    def system_prompt(self, tokens: int, seed: int = 0) -> str:
        """A shared system prompt of about ``tokens`` tokens (the same text for the same ``seed``)."""
        return "System: " + " ".join(WORDS[(seed * 11 + i * 5) % len(WORDS)] for i in range(
            max(1, round(tokens * self.words_per_token) - 2))) + "\n"

    def _body(self, prompt: str, max_tokens: int, stream: bool = True) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.model:
            body["model"] = self.model
        return body

    def stream(self, prompt: str, max_tokens: int, on_chunk=None, stop: threading.Event | None = None) -> dict:
        """One streaming request: send time, each text chunk's arrival time, usage; ``on_chunk(i)`` after
        chunk i; leaves early (closing the connection) once ``stop`` is set."""
        rec = {"sent": time.perf_counter(), "chunks": [], "text": "", "finish_reason": None, "done_event": False,
               "usage": None, "error": None}
        try:
            with self.http.stream("POST", self.url + "/v1/completions", json=self._body(prompt, max_tokens),
                                  headers=self.headers) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                    return rec
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        rec["done_event"] = True
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    rec.setdefault("id", event.get("id"))
                    if "error" in event:
                        rec["error"] = event["error"].get("message")
                    if event.get("usage"):
                        rec["usage"] = event["usage"]
                    for c in event.get("choices", []):
                        rec["finish_reason"] = c.get("finish_reason") or rec["finish_reason"]
                    if any(c.get("text") for c in event.get("choices", [])):
                        rec["chunks"].append(time.perf_counter())
                        rec["text"] += "".join(c.get("text") or "" for c in event["choices"])
                        if on_chunk is not None:
                            on_chunk(len(rec["chunks"]))
                    if stop is not None and stop.is_set():
                        break
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["done"] = time.perf_counter()
        return rec

    def health(self) -> dict:
        try:
            return self.http.get(self.url + "/health", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return {}


@dataclasses.dataclass(frozen=True)
class Mix:
    """A request mix: prompts of ``prompt_lo``..``prompt_hi`` tokens and answers of ``output_lo``..``output_hi``
    (deterministic draws per request), a ``shared_fraction`` of the requests starting with one
    ``shared_tokens``-token system prompt (their own part then fills the rest, at least ``prompt_lo``)."""

    prompt_lo: int
    prompt_hi: int
    output_lo: int
    output_hi: int
    shared_tokens: int = 0
    shared_fraction: float = 0.0

    @classmethod
    def fixed(cls, prompt_tokens: int, max_tokens: int) -> "Mix":
        """About ``prompt_tokens`` prompts, answers between half ``max_tokens`` and all of it."""
        return cls(prompt_tokens, prompt_tokens, max(1, max_tokens // 2), max_tokens)

    def request(self, client: "Client", i: int, seed: int) -> tuple[str, int, bool]:
        """(prompt, max_tokens, shared) of request ``i``."""
        draw = lambda lo, hi, k: lo + (i * k) % (hi - lo + 1)  # noqa: E731 - spread, reproducible
        out = draw(self.output_lo, self.output_hi, 7919)
        shared = self.shared_tokens > 0 and (i * 0.618034) % 1.0 < self.shared_fraction
        if not shared:
            return client.prompt(draw(self.prompt_lo, self.prompt_hi, 104729), seed), out, False
        own = max(self.prompt_lo, draw(self.prompt_lo, self.prompt_hi, 104729) - self.shared_tokens)
        return client.system_prompt(self.shared_tokens) + client.prompt(own, seed), out, True


class HealthSampler:
    """Polls the server's ``/health`` every ``period_s`` while a level runs: the most KV pages in use and the
    preemptions during it (paged servers; empty otherwise)."""

    def __init__(self, client: "Client", period_s: float = 0.5):
        self.client, self.period_s, self.stop = client, period_s, threading.Event()
        first = client.health()
        self.first, self.first_steps = first.get("kv_cache", {}), first.get("steps")
        self.peak_used = self.first.get("pages_used", 0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.period_s):
            self.peak_used = max(self.peak_used, self.client.health().get("kv_cache", {}).get("pages_used", 0))

    def summary(self) -> dict:
        self.stop.set()
        self.thread.join()
        health = self.client.health()
        out = step_summary(self.first_steps, health.get("steps"))
        last = health.get("kv_cache", {})
        if last.get("kind") != "paged":
            return out
        hits = last["prefix_hits"] - self.first.get("prefix_hits", 0)
        queries = last["prefix_queries"] - self.first.get("prefix_queries", 0)
        return {**out, "kv_pages_total": last["pages_total"], "kv_pages_peak_used": self.peak_used,
                "kv_pages_peak_since_start": last.get("pages_used_peak"),
                "kv_page_size": last["page_size"], "server_hit_rate": hits / queries if queries else 0.0,
                "preempted": last["preempted"] - self.first.get("preempted", 0)}


def step_summary(before: dict | None, after: dict | None) -> dict:
    """Our server's scheduler steps during a level (two ``/health`` ``steps`` readings): the mean step's
    time, the part of it the host waited for the device (near 1: the device paces the server; low: the
    host does), the part spent dispatching, the part the scheduler's thread ran on a CPU (the rest, beside
    the device wait, it waited for the interpreter lock), the running rows a decode block advanced and the prompt tokens a
    step read. Empty for a server without them."""
    if not before or not after:
        return {}
    d = {k: after[k] - before[k] for k in after}
    if not d["steps"]:
        return {}
    return {"steps": d["steps"], "step_ms_mean": 1000 * d["busy_s"] / d["steps"],
            "step_device_wait_fraction": d["device_wait_s"] / d["busy_s"] if d["busy_s"] else 0.0,
            "step_dispatch_fraction": d["dispatch_s"] / d["busy_s"] if d["busy_s"] else 0.0,
            "step_cpu_fraction": d.get("cpu_s", 0.0) / d["busy_s"] if d["busy_s"] else 0.0,
            "decode_rows_mean": d["decode_rows"] / d["decode_steps"] if d["decode_steps"] else 0.0,
            "prefill_step_fraction": d["prefill_steps"] / d["steps"], "prefill_tokens": d["prefill_tokens"],
            "prefill_tokens_per_step": d["prefill_tokens"] / d["steps"]}


def steady_window(records: list[dict], concurrency: int) -> dict:
    """The level while every client had a request in flight: from the moment the last client sent its
    first request to the moment the first client got the end of its last one. The whole level also holds the
    start (clients joining one by one) and the end (clients whose answers were shorter idle while the
    others finish), when fewer than ``concurrency`` streams run; this window is the rate at that
    concurrency. Tokens are counted by the text chunks that arrived inside it (a chunk of a request that
    carried several tokens counts its share); None when the window is shorter than a second, a client sent
    nothing or a request failed."""
    by_client: dict[int, list[dict]] = {}
    for r in records:
        by_client.setdefault(r["client"], []).append(r)
    none = {"steady_s": None, "steady_output_tokens_per_s": None, "steady_itl_p50_s": None, "steady_itl_p99_s": None}
    if len(by_client) < concurrency or any(r["error"] for r in records):
        return none
    start = max(min(r["sent"] for r in rs) for rs in by_client.values())
    end = min(max(r["done"] for r in rs) for rs in by_client.values())
    if end - start < 1.0:
        return none
    tokens, itl = 0.0, []
    for r in records:
        if not r["chunks"] or not r["usage"]:
            continue
        per_chunk = r["usage"]["completion_tokens"] / len(r["chunks"])
        tokens += per_chunk * sum(start <= t < end for t in r["chunks"])
        itl += [(b - a) / per_chunk for a, b in zip(r["chunks"], r["chunks"][1:]) if start <= b < end]
    return {"steady_s": end - start, "steady_output_tokens_per_s": tokens / (end - start),
            "steady_itl_p50_s": percentile(itl, 50), "steady_itl_p99_s": percentile(itl, 99)}


def run_level(client: Client, concurrency: int, requests: int, mix: Mix, spread_s: float = 0.0) -> dict:
    """``requests`` closed-loop requests of ``mix`` over ``concurrency`` clients, client i starting
    ``i * spread_s / concurrency`` seconds after the first (independent users, not one synchronised wave);
    the level's summary."""
    lock, counter, records = threading.Lock(), [0], []
    sampler = HealthSampler(client)

    def worker(k):
        time.sleep(k * spread_s / concurrency)
        while True:
            with lock:
                i = counter[0]
                if i >= requests:
                    return
                counter[0] += 1
            prompt, max_tokens, shared = mix.request(client, i, 1000 * concurrency + i)
            rec = client.stream(prompt, max_tokens)
            rec["shared"], rec["client"] = shared, k
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    kv = sampler.summary()
    ok = [r for r in records if not r["error"] and r["chunks"]]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in ok if r["usage"]]
    prompt_total = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    itl = []
    for r in ok:
        gaps = [b - a for a, b in zip(r["chunks"], r["chunks"][1:])]
        if gaps and r["usage"]:  # a chunk may carry several tokens (a speculative round, a decode block)
            per_chunk = max(1.0, (r["usage"]["completion_tokens"] - 1) / len(gaps))
            itl += [g / per_chunk for g in gaps]
    return {
        "concurrency": concurrency, "requests": requests, "completed": len(ok),
        **steady_window(records, concurrency),
        "errors": sorted({r["error"] for r in records if r["error"]}),
        "prompt_tokens_mean": statistics.mean(r["usage"]["prompt_tokens"] for r in ok if r["usage"]) if ok else None,
        "output_tokens": out_tokens, "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(ok) / wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile([r["done"] - r["sent"] for r in ok], 50), "arrival_spread_s": spread_s,
        "cached_prompt_fraction": sum(cached) / prompt_total if prompt_total else 0.0,
        "ttft_shared_p50_s": percentile([r["chunks"][0] - r["sent"] for r in ok if r["shared"]], 50),
        "ttft_unshared_p50_s": percentile([r["chunks"][0] - r["sent"] for r in ok if not r["shared"]], 50),
        **kv, "ttfts_s": sorted(ttft), "ids": [r.get("id") for r in ok],
    }


def run_prefix(client: Client, pairs: int, prompt_tokens: int, tail_tokens: int) -> dict:
    """Prefix-cache latency, one request at a time: ``pairs`` times a new ``prompt_tokens``-token prompt
    (a miss), then the same prompt with another ``tail_tokens``-token ending (a hit on all its whole pages);
    TTFT p50 of the hits, of the misses, and their ratio."""
    miss, hit, cached = [], [], []
    for k in range(pairs):
        system = client.system_prompt(prompt_tokens - tail_tokens, seed=70_000 + k)
        for seed, out in ((2 * k, miss), (2 * k + 1, hit)):
            rec = client.stream(system + client.prompt(tail_tokens, 80_000 + seed), 2)
            if rec["error"] or not rec["chunks"]:
                raise RuntimeError(f"prefix scenario request failed: {rec['error']}")
            out.append(rec["chunks"][0] - rec["sent"])
            if out is hit:
                cached.append((rec["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    m, h = percentile(miss, 50), percentile(hit, 50)
    return {"pairs": pairs, "prompt_tokens": prompt_tokens, "miss_ttft_p50_s": m, "hit_ttft_p50_s": h,
            "hit_over_miss": h / m if m else None, "hit_cached_tokens_mean": statistics.mean(cached),
            "miss_ttfts_s": miss, "hit_ttfts_s": hit}


def run_interference(client: Client, streams: int, long_tokens: int, prompt_tokens: int, warm_chunks: int = 8,
                     after_chunks: int = 3, max_tokens: int = 4000) -> dict:
    """``streams`` streams decode; a ``long_tokens`` prompt arrives once each has ``warm_chunks`` chunks
    (the gaps between those are the streams' steady rhythm). Then every stream's gaps from the arrival
    (the gap spanning it included) to ``after_chunks`` chunks past the long prompt's first token, when
    the streams are closed."""
    warmed = threading.Semaphore(0)
    stop = threading.Event()
    records: list[dict] = [None] * streams

    def run_stream(i):
        def on_chunk(n):
            if n == warm_chunks:
                warmed.release()
        records[i] = client.stream(client.prompt(prompt_tokens, 50_000 + i), max_tokens, on_chunk, stop)
        if len(records[i]["chunks"]) < warm_chunks:  # it ended early (an error): do not wait for it
            warmed.release()

    threads = [threading.Thread(target=run_stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for _ in range(streams):
        warmed.acquire()
    arrival = time.perf_counter()
    long_rec = client.stream(client.prompt(long_tokens, 99_999), 1 + after_chunks)
    stop.set()
    for t in threads:
        t.join()
    end = long_rec["done"]
    steady, window, per_stream = [], [], []
    for r in records:
        before = [t for t in r["chunks"] if t < arrival]
        during = ([before[-1]] if before else []) + [t for t in r["chunks"] if arrival <= t <= end]
        s_gaps = [b - a for a, b in zip(before[1:], before[2:])]  # past the first chunk's prefill
        w_gaps = [b - a for a, b in zip(during, during[1:])]
        steady += s_gaps
        window += w_gaps
        if w_gaps:
            per_stream.append({"steady_median_gap_s": statistics.median(s_gaps) if s_gaps else None,
                               "median_gap_s": statistics.median(w_gaps), "max_gap_s": max(w_gaps),
                               "max_gap_ends_s": during[w_gaps.index(max(w_gaps)) + 1] - arrival,  # after the arrival
                               "gaps": len(w_gaps)})
    steady_median = statistics.median(steady) if steady else None
    median = statistics.median(steady + window) if steady + window else None
    longest = max(window) if window else None
    return {
        "streams": streams, "long_prompt_tokens": (long_rec["usage"] or {}).get("prompt_tokens"),
        "long_prompt_ttft_s": (long_rec["chunks"][0] if long_rec["chunks"] else end) - long_rec["sent"],
        "long_prompt_text": long_rec["text"], "long_prompt_error": long_rec["error"], "stream_errors": sorted({r["error"] for r in records if r["error"]}),
        "steady_median_gap_s": steady_median,  # before the long prompt arrived
        "window_median_gap_s": statistics.median(window) if window else None,  # while it was read
        "median_gap_s": median, "max_gap_s": longest,  # median over both; the longest gap while it was read
        "max_over_median": longest / median if median else None,
        "max_over_steady_median": longest / steady_median if steady_median else None,
        "per_stream": per_stream,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (else one is started per --server)")
    p.add_argument("--api_key")
    p.add_argument("--model", help="the model name to send (default: none, the server's own)")
    p.add_argument("--server", action="append", default=[],
                   help="NAME=FLAGS: start `python -m minicpm_jax.server FLAGS` (repeatable; default: the demo model)")
    p.add_argument("--scenarios", default="load", help="comma-separated: load, interference")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: --requests_per_client per client, at least 8)")
    p.add_argument("--requests_per_client", type=int, default=4)
    p.add_argument("--prompt_tokens", type=int, default=128)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--prompt_range", help="LO,HI: load prompts of LO..HI tokens (instead of --prompt_tokens)")
    p.add_argument("--output_range", help="LO,HI: load answers of LO..HI tokens (instead of --max_tokens)")
    p.add_argument("--shared_prefix_tokens", type=int, default=0,
                   help="load: a system prompt of this many tokens that --shared_fraction of the requests start with")
    p.add_argument("--shared_fraction", type=float, default=0.5)
    p.add_argument("--prefix_pairs", type=int, default=4, help="prefix: miss/hit request pairs")
    p.add_argument("--prefix_prompt_tokens", type=int, default=2048, help="prefix: the prompts' length")
    p.add_argument("--prefix_tail_tokens", type=int, default=32, help="prefix: the part after the shared prefix")
    p.add_argument("--streams", type=int, default=8, help="interference: decoding streams")
    p.add_argument("--long_prompt_tokens", type=int, default=2000, help="interference: the arriving prompt")
    p.add_argument("--stream_max_tokens", type=int, default=1000,
                   help="interference: the streams' max_tokens (they are closed once the long prompt has answered)")
    p.add_argument("--log_dir", default="/tmp", help="where started servers write their logs")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - {"load", "interference", "prefix"}
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}")
    levels = [int(c) for c in args.concurrency.split(",") if c]

    def pair(text: str | None, name: str) -> tuple[int, int] | None:
        if text is None:
            return None
        try:
            lo, hi = (int(x) for x in text.split(","))
        except ValueError:
            p.error(f"--{name} takes LO,HI, got {text!r}")
        if not 1 <= lo <= hi:
            p.error(f"--{name} needs 1 <= LO <= HI, got {text!r}")
        return lo, hi

    prompts, outputs = pair(args.prompt_range, "prompt_range"), pair(args.output_range, "output_range")
    fixed = Mix.fixed(args.prompt_tokens, args.max_tokens)
    mix = Mix(*(prompts or (fixed.prompt_lo, fixed.prompt_hi)), *(outputs or (fixed.output_lo, fixed.output_hi)),
              args.shared_prefix_tokens, args.shared_fraction)
    configs = [(None, None)] if args.url else [tuple(s.split("=", 1)) if "=" in s else (s, "") for s in args.server] \
        or [("demo", "")]
    results = {"scenarios": scenarios, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "mix": dataclasses.asdict(mix), "runs": []}

    def save() -> None:  # after every level too: a run cut short keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for name, server_flags in configs:
        server = None
        if args.url is None:
            log = os.path.join(args.log_dir, f"serve-bench-{name}.log")
            print(f"[{name}] starting the server: {server_flags}", file=sys.stderr, flush=True)
            server = ServerProcess(shlex.split(server_flags), log)
        try:
            client = Client(args.url or server.url, args.api_key, args.model)
            client.calibrate()
            # Two warm-up requests: the first may still meet compilations (another server's, or shapes a
            # server compiles lazily); the second's latency is one request's time, over which the clients'
            # first requests are spread.
            for seed in (7, 8):
                warm = client.stream(client.prompt(mix.prompt_lo, seed), mix.output_hi)
                if warm["error"]:
                    raise RuntimeError(f"the warm-up request failed: {warm['error']}")
            spread = warm["done"] - warm["sent"]
            run = {"name": name or args.url, "server_flags": server_flags, "levels": []}
            results["runs"].append(run)
            if "load" in scenarios:
                for c in levels:
                    n = args.requests or max(8, args.requests_per_client * c)
                    level = run_level(client, c, n, mix, spread)
                    health = client.health()
                    if "spec_mean_accept_length" in health:
                        level["spec_mean_accept_length"] = health["spec_mean_accept_length"]
                    run["levels"].append(level)
                    save()
                    steady = (f" (while all {c} streams ran, {level['steady_s']:.1f} s: "
                              f"{level['steady_output_tokens_per_s']:.1f} tok/s, ITL p50 {level['steady_itl_p50_s']:.4f} s)"
                              if level["steady_s"] else "")
                    print(f"[{run['name']}] c={c}: {level['output_tokens_per_s']:.1f} tok/s{steady}, "
                          f"TTFT p50 {level['ttft_p50_s']:.3f} s p99 {level['ttft_p99_s']:.3f} s, "
                          f"ITL p50 {level['itl_p50_s']:.4f} s p99 {level['itl_p99_s']:.4f} s, cached "
                          f"{100 * level['cached_prompt_fraction']:.0f}% of prompt tokens"
                          + (f", KV pages peak {level['kv_pages_peak_used']}/{level['kv_pages_total']}, preempted "
                             f"{level['preempted']}" if "kv_pages_total" in level else "")
                          + (f"; steps {level['step_ms_mean']:.1f} ms, {100 * level['step_device_wait_fraction']:.0f}% "
                             f"waiting for the device, {level['decode_rows_mean']:.1f} rows decoded, "
                             f"{level['prefill_tokens_per_step']:.0f} prompt tokens a step" if "steps" in level else "")
                          + f"{', errors ' + str(level['errors']) if level['errors'] else ''}", file=sys.stderr, flush=True)
            if "prefix" in scenarios:
                run["prefix"] = r = run_prefix(client, args.prefix_pairs, args.prefix_prompt_tokens,
                                               args.prefix_tail_tokens)
                print(f"[{run['name']}] prefix cache: TTFT p50 miss {r['miss_ttft_p50_s']:.3f} s, hit "
                      f"{r['hit_ttft_p50_s']:.3f} s ({r['hit_over_miss']:.2f}x), {r['hit_cached_tokens_mean']:.0f} "
                      "cached tokens per hit", file=sys.stderr, flush=True)
            if "interference" in scenarios:
                run["interference"] = r = run_interference(client, args.streams, args.long_prompt_tokens,
                                                           mix.prompt_lo, max_tokens=args.stream_max_tokens)
                print(f"[{run['name']}] {args.streams} streams + a {r['long_prompt_tokens']}-token prompt: gaps median "
                      f"{r['median_gap_s']:.3f} s (steady {r['steady_median_gap_s']:.3f} s, while it is read "
                      f"{r['window_median_gap_s']:.3f} s), longest {r['max_gap_s']:.3f} s ({r['max_over_median']:.2f}x "
                      f"the median, {r['max_over_steady_median']:.2f}x the steady one); its TTFT "
                      f"{r['long_prompt_ttft_s']:.2f} s", file=sys.stderr, flush=True)
            save()
        finally:
            if server is not None:
                server.stop()
    save()
    return results


if __name__ == "__main__":
    main()
