"""The serving load generator (``benchmarks/serve.py``): on the CPU with the demo model and tiny settings it
starts a server, runs every scenario and writes JSON with the numbers the GPU benchmark records."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve

pytestmark = pytest.mark.smollm2


def test_load_generator_runs_every_scenario_and_writes_json(smollm2_2_layers_dir, tmp_path):
    out = tmp_path / "serve.json"
    # The demo model cut to two layers: what is checked is the load generator and the server's statistics,
    # not the answers, and the server compiles as it serves (--nowarm_up): two layers, not 30.
    serve.main(["--server", f"demo=--model_path {smollm2_2_layers_dir} --max_batch_size 2 --max_length 160 "
                "--page_size 16 --nowarm_up",
                "--scenarios", "load,interference,prefix", "--concurrency", "1,2", "--requests", "2",
                "--prompt_range", "12,20", "--output_range", "2,4", "--shared_prefix_tokens", "40",
                "--streams", "1", "--long_prompt_tokens", "100", "--stream_max_tokens", "120",
                "--prefix_pairs", "1", "--prefix_prompt_tokens", "60", "--prefix_tail_tokens", "8",
                "--log_dir", str(tmp_path), "--out", str(out)])
    results = json.loads(out.read_text())
    (run,) = results["runs"]
    assert run["name"] == "demo" and [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    for level in run["levels"]:
        assert level["completed"] == 2 and not level["errors"]
        assert level["output_tokens"] >= 4 and level["output_tokens_per_s"] > 0  # 2..4 tokens a request
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"] and 0 < level["itl_p50_s"] <= level["itl_p99_s"]
        assert 10 <= level["prompt_tokens_mean"] <= 70  # calibrated: own parts of 12..20, one 40-token system prompt
        # Polled peaks may miss a CPU level's short requests; the server's own high-water mark does not.
        assert level["kv_pages_total"] == 2 * 10 and 0 <= level["kv_pages_peak_used"] <= 20 and level["preempted"] == 0
        assert 0 < level["kv_pages_peak_since_start"] <= 20
        # The server's step statistics: it read every uncached prompt token once, in steps that also decoded.
        uncached = level["prompt_tokens_mean"] * 2 * (1 - level["cached_prompt_fraction"])
        assert level["prefill_tokens"] == round(uncached) and level["steps"] >= 2 and level["decode_rows_mean"] >= 1
        assert 0 < level["step_device_wait_fraction"] < 1 and 0 < level["step_dispatch_fraction"] < 1
        assert 0 < level["step_cpu_fraction"] <= 1.01
        assert "steady_output_tokens_per_s" in level and "steady_itl_p50_s" in level
    # The second level's request with the system prompt finds it cached (the first level computed it).
    assert run["levels"][0]["cached_prompt_fraction"] == 0 < run["levels"][1]["cached_prompt_fraction"]
    prefix = run["prefix"]
    assert prefix["hit_cached_tokens_mean"] >= 48 and prefix["miss_ttft_p50_s"] > 0 and prefix["hit_over_miss"] > 0
    inter = run["interference"]
    assert inter["long_prompt_tokens"] >= 80 and not inter["long_prompt_error"] and not inter["stream_errors"]
    assert inter["max_gap_s"] > 0 and inter["max_over_median"] >= 1 and inter["long_prompt_ttft_s"] > 0
    with pytest.raises(SystemExit):
        serve.main(["--scenarios", "nonsense"])


def _rec(client, sent, chunks, tokens):
    return {"client": client, "sent": sent, "done": chunks[-1], "chunks": chunks, "error": None,
            "usage": {"completion_tokens": tokens}}


def test_steady_window_counts_only_the_time_every_client_was_busy():
    # Client 0 runs 0-4 then 4-10; client 1 joins at 2 and ends at 8: the window is [2, 8).
    records = [_rec(0, 0.0, [1.0, 2.0, 3.0, 4.0], 4), _rec(0, 4.0, [5.0, 7.0, 9.0, 10.0], 8),
               _rec(1, 2.0, [2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.0], 7)]
    w = serve.steady_window(records, 2)
    assert w["steady_s"] == 6.0
    # In [2, 8): chunks 2.0, 3.0, 4.0 (1 token each), 5.0, 7.0 (2 tokens each), 2.5..7.5 (six of client 1's).
    assert w["steady_output_tokens_per_s"] == pytest.approx((3 + 4 + 6) / 6.0)
    # Gaps ending inside it, per token: 1 x3 (client 0, first request), 1 (5.0 -> 7.0: 2 s for 2 tokens), 1 x5.
    assert w["steady_itl_p50_s"] == pytest.approx(1.0)
    assert serve.steady_window(records[:2], 2)["steady_s"] is None  # a client never ran: no such window
    assert serve.steady_window([_rec(0, 0.0, [0.5], 1), _rec(1, 0.2, [0.9], 1)], 2)["steady_s"] is None
