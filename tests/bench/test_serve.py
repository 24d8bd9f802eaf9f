"""The serving load generator (``benchmarks/serve.py``): on the CPU with the demo model and tiny settings it
starts a server, runs both scenarios and writes JSON with the numbers the GPU benchmark records."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve

pytestmark = pytest.mark.smollm2


def test_load_generator_runs_both_scenarios_and_writes_json(smollm2_dir, tmp_path):
    out = tmp_path / "serve.json"
    serve.main(["--server", "demo=--max_batch_size 2 --max_length 160", "--scenarios", "load,interference",
                "--concurrency", "1,2", "--requests", "2", "--prompt_tokens", "16", "--max_tokens", "4",
                "--streams", "1", "--long_prompt_tokens", "100", "--stream_max_tokens", "120",
                "--log_dir", str(tmp_path), "--out", str(out)])
    results = json.loads(out.read_text())
    (run,) = results["runs"]
    assert run["name"] == "demo" and [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    for level in run["levels"]:
        assert level["completed"] == 2 and not level["errors"]
        assert level["output_tokens"] >= 4 and level["output_tokens_per_s"] > 0  # 2..4 tokens a request
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"] and 0 < level["itl_p50_s"] <= level["itl_p99_s"]
        assert 12 <= level["prompt_tokens_mean"] <= 24  # calibrated to about --prompt_tokens
    inter = run["interference"]
    assert inter["long_prompt_tokens"] >= 80 and not inter["long_prompt_error"] and not inter["stream_errors"]
    assert inter["max_gap_s"] > 0 and inter["max_over_median"] >= 1 and inter["long_prompt_ttft_s"] > 0
    with pytest.raises(SystemExit):
        serve.main(["--scenarios", "nonsense"])
