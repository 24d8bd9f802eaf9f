"""The benchmark harness (``benchmarks/``, outside the library): the timing loop keeps every timed call
live, the CLI runs end to end on the CPU (smoke numbers only), rejects bad flags, and draws its plot from
saved JSON; the spec scenario's oracle acceptance rule accepts exactly K tokens a round."""

from __future__ import annotations

import json
import os
import statistics
from types import SimpleNamespace
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.int4 import add_peer, int4_markdown
from benchmarks.spec import oracle_accept
from benchmarks.timing import (
    NO_LOOP_GRAPHS, carried_loop, carried_loop_time, device_loop, device_loop_time, gpu_timeline, hlo_op_paths,
    kernel_op_paths, kernel_seconds, loop_kernel_time, recompiled, scoped_seconds,
)
from minicpm_jax.config import DraftSpec, ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.speculative.engine import EagleSteps
from minicpm_jax.engine.speculative.rounds import SpecConfig
from minicpm_jax.engine.steps import Compiled
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.draft import EagleDraft
from tests.helpers import tiny_minicpm_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_device_loop_keeps_every_output_and_chains_calls():
    """A list of three independent calls must all survive dead-code elimination inside the timed loop."""
    fn = lambda x, n: [jnp.sin(x * (i + 2) + n) for i in range(3)]
    args = (jnp.linspace(0, 1, 64), jnp.zeros((), jnp.int32))
    hlo = device_loop(fn, args, iters=4).lower(*args).compile().as_text()
    assert hlo.count("sine(") >= 3
    times = device_loop_time(fn, args, iters=4, repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_carried_loop_writes_its_cache_in_place():
    """A call that writes into a cache: the plain loop must copy the whole (loop-invariant) cache before
    each write and times that copy too; the carried loop writes in place, and its carry advances."""
    cache = jnp.zeros((8, 4096), jnp.float32)
    copies = lambda hlo: sum(" copy(" in line and "f32[8,4096]" in line.split("copy(")[0]  # noqa: E731
                             for line in hlo.splitlines())

    def write(x, c):
        c = c.at[3].add(x)
        return c, jnp.max(c @ x)  # a read of all of the new version, as attention reads the written cache

    plain = device_loop(lambda x, c: write(x, c)[1], (jnp.ones(4096), cache), iters=4, chain=0)
    assert copies(plain.lower(jnp.ones(4096), cache).compile().as_text()) >= 1

    def step(x, carry):
        c, _ = write(x, carry[0])
        return c, carry[1] + c[3, 0]  # (a read of the old version after the write would need a copy again)

    carry = (cache, jnp.zeros((), jnp.float32))
    assert copies(carried_loop(step, iters=4).lower((jnp.ones(4096),), carry).compile().as_text()) == 0
    times, (out, probe) = carried_loop_time(step, (jnp.ones(4096),), carry, iters=4, repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    np.testing.assert_array_equal(np.asarray(out[3]), np.full(4096, 12.0))  # 3 runs x 4 calls
    assert float(probe) == sum(range(1, 13)) and np.asarray(out[:3]).sum() == 0


def test_kernel_seconds_sums_gpu_stream_events_by_kernel():
    """Only events on a GPU plane's stream lines count; per-launch-site copies (``__N``) share a name;
    the CPU's trace has none, so the kernel clock reports None there."""
    ev = lambda name, ns: SimpleNamespace(name=name, duration_ns=ns, stats=[])  # noqa: E731
    line = lambda name, *events: SimpleNamespace(name=name, events=list(events))  # noqa: E731
    planes = [
        SimpleNamespace(name="/device:GPU:0", lines=[
            line("Stream #13(Compute)", ev("decode_attention", 5000), ev("decode_attention__3", 7000),
                 ev("input_reduce_fusion_2", 1000)),
            line("XLA Ops", ev("decode_attention", 99999)),  # the op view of the same kernels: not counted
        ]),
        SimpleNamespace(name="/host:CPU", lines=[line("Stream #1", ev("decode_attention", 99999))]),
    ]
    assert kernel_seconds(planes) == pytest.approx({"decode_attention": 12e-6, "input_reduce_fusion_2": 1e-6})
    # A kernel's op path: the first of its stream events that carries one (the name stat); the op view ignored.
    planes[0].lines[0].events[1].stats = [("name", "jit(f)/while/body/layers/attention/pallas_call")]
    planes[0].lines[1].events[0].stats = [("name", "jit(f)/op_view")]
    assert kernel_op_paths(planes) == {"decode_attention": "jit(f)/while/body/layers/attention/pallas_call"}
    args = (jnp.linspace(0, 1, 64), jnp.zeros((), jnp.int32))
    assert loop_kernel_time(device_loop(lambda x, n: jnp.sin(x + n), args, iters=2), args, iters=2) is None


def test_gpu_timeline_merges_streams_and_counts_idle_gaps():
    """One GPU's kernels on two streams (overlaps counted once), its op view and other GPUs ignored; a
    1 µs gap is not idle, a 5 µs one is (both with the 3 µs default threshold). Worked by hand:
    [0, 10) ∪ [4, 12) on two streams, then [13, 20) holding [14, 16), then [25, 30): span 30, busy
    12 + 7 + 5 = 24 µs."""
    ev = lambda start, dur: SimpleNamespace(name="k", start_ns=start * 1000, duration_ns=dur * 1000)  # noqa: E731
    line = lambda name, *events: SimpleNamespace(name=name, events=list(events))  # noqa: E731
    planes = [
        SimpleNamespace(name="/device:GPU:0", lines=[
            line("Stream #13(Compute)", ev(0, 10), ev(13, 7)), line("Stream #14(Compute)", ev(4, 8), ev(14, 2), ev(25, 5)),
            line("XLA Ops", ev(0, 100))]),
        SimpleNamespace(name="/device:GPU:1", lines=[line("Stream #13(Compute)", ev(50, 100))]),
    ]
    t = gpu_timeline(planes, device=0)
    assert t["span_s"] == pytest.approx(30e-6) and t["busy_s"] == pytest.approx(24e-6)
    assert t["kernels"] == 5 and t["gaps"] == 1 and t["gaps_s"] == pytest.approx(5e-6)
    assert gpu_timeline(planes, device=1)["busy_s"] == pytest.approx(100e-6)
    assert gpu_timeline(planes, device=2) == {"span_s": 0.0, "busy_s": 0.0, "kernels": 0, "gaps_s": 0.0, "gaps": 0}


def test_recompiled_swaps_the_named_programs_options_in_and_back():
    """A trace's programs: inside ``recompiled`` the steps hold a Compiled with the options (only the named
    programs recompile: tests/engine/test_engine.py), after it the original, also when the body raises."""
    base = Compiled({"decode": jax.jit(lambda x: x + 1), "prefill": jax.jit(lambda x: x * 2)})
    steps = SimpleNamespace(compiled=base)
    with pytest.raises(RuntimeError, match="inside"):
        with recompiled(steps, {"decode"}, NO_LOOP_GRAPHS):
            assert steps.compiled is not base and steps.compiled.compiler_options == NO_LOOP_GRAPHS
            np.testing.assert_array_equal(steps.compiled("decode", None, jnp.arange(3.0)), jnp.arange(1.0, 4.0))
            raise RuntimeError("inside")
    assert steps.compiled is base
    kinds = NO_LOOP_GRAPHS["xla_gpu_enable_command_buffer"].split(",")
    assert "FUSION" in kinds and "CUSTOM_CALL" in kinds and not {"WHILE", "CONDITIONAL"} & set(kinds)


def test_scoped_seconds_splits_a_program_by_named_scope():
    """A GPU's kernels of the named modules by the first scope on their op path (a fusion whose path stops
    above every scope is "other"); another program, the op view and another GPU are ignored; idle is the
    uncovered time. Worked by hand (µs): a [0, 4), b [3, 10) (kernels of a stream can overlap a little: both
    count), fusion [12, 13), a [20, 22): span 22, busy 13, idle 9, the parts 1 µs over the span. The CPU form:
    the host's leaf events (the loop's event that holds them is not counted twice), paths from the HLO text."""
    def ev(start, dur, **stats):
        return SimpleNamespace(start_ns=start * 1000, duration_ns=dur * 1000, stats=list(stats.items()))

    line = lambda name, *events: SimpleNamespace(name=name, events=list(events))  # noqa: E731
    mod = dict(hlo_module="jit_decode", hlo_op="f")
    planes = [SimpleNamespace(name="/device:GPU:0", lines=[
        line("Stream #13(Compute)", ev(0, 4, name="jit(decode)/while/body/spec_draft/dot", **mod),
             ev(3, 7, name="jit(decode)/while/body/spec_verify/spec_draft_like/x", **mod),
             ev(12, 1, name="jit(decode)/while/body", **mod), ev(15, 3, name="jit(prefill)/spec_verify/dot",
                                                                  hlo_module="jit_prefill", hlo_op="g"),
             ev(20, 2, name="jit(decode)/spec_draft/pallas_call", **mod)),
        line("XLA Ops", ev(0, 100, name="jit(decode)/spec_verify", **mod))]),
        SimpleNamespace(name="/device:GPU:1", lines=[
            line("Stream #13(Compute)", ev(0, 50, name="spec_verify", **mod))])]
    t = scoped_seconds(iter(planes), {"jit_decode"}, ("spec_draft", "spec_verify"))
    assert t["spec_draft"] == pytest.approx(6e-6) and t["spec_verify"] == pytest.approx(7e-6)
    assert t["other"] == pytest.approx(1e-6) and t["idle"] == pytest.approx(9e-6) and t["kernels"] == 4
    assert t["span"] + 1e-6 == pytest.approx(sum(t[k] for k in ("spec_draft", "spec_verify", "other", "idle")))
    hlo = ('HloModule jit_decode\n  %fusion.3 = f32[4] fusion(%p), metadata={op_name="jit(decode)/spec_verify/dot"}\n'
           '  ROOT %while.1 = (f32[4]) while(%t), metadata={op_name="jit(decode)/while"}\n')
    paths = hlo_op_paths(hlo)
    assert paths == {"fusion.3": "jit(decode)/spec_verify/dot", "while.1": "jit(decode)/while"}
    cpu = [SimpleNamespace(name="/host:CPU", lines=[line("tf_XLAPjRtCpuClient", ev(0, 10, hlo_module="jit_decode",
                                                                                   hlo_op="while.1"),
                                                         ev(2, 5, hlo_module="jit_decode", hlo_op="fusion.3"))])]
    t = scoped_seconds(cpu, {"jit_decode"}, ("spec_verify",), op_paths=paths)
    assert t["spec_verify"] == pytest.approx(5e-6) and t["other"] == 0 and t["kernels"] == 1


def test_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    png = tmp_path / "bench.png"
    r = _bench("--scenarios", "kernels,e2e", "--shape", "minicpm4-tiny", "--contexts", "40", "--attention_impls",
               "xla,pallas", "--kv_caches", "contiguous,paged", "--prefill_contexts", "32", "--decode_contexts", "64",
               # 2 layers' caches per timed decode-kernel call, not the 32 a tiny cache gets to stream past an
               # H100's L2: the 32 unrolled interpret-mode Pallas calls (x 200) were half of this test's time.
               "--decode_kernel_layers", "2", "--decode_steps", "4",
               "--decode_block", "2", "--chunk_length", "32", "--dtype", "float32", "--repeats", "1",
               "--json_out", str(out), "--markdown_out", str(md), "--plot", str(png))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(row["attention_impl"], row["kv_cache"]) for row in result["rows"]] == [
        ("xla", "contiguous"), ("xla", "paged"), ("pallas", "contiguous"), ("pallas", "paged")]
    for row in result["rows"]:
        assert row["context"] == 40 and len(row["decode_ms_per_token"]) == 1 and row["decode_ms_per_token"][0] > 0
        assert row["program_bytes"] > row["cache_bytes"] > 0  # the largest program holds the cache and more
    assert result["kernels"]["decode"][0]["layers"] == 2
    for kind in ("prefill", "decode"):
        sec = result["kernels"][kind][0]["seconds"]
        assert isinstance(sec["pallas"], list) and sec["pallas"][0] > 0
        assert isinstance(sec["xla"], list) and sec["xla"][0] > 0
        assert isinstance(sec["cudnn"], str)  # no cuDNN on the CPU: reported, not fatal
    assert "| minicpm4-tiny | pallas | none | off | 1 | contiguous | 1 | 40 |" in r.stdout
    assert md.read_text().strip() == r.stdout.strip()
    paged = [line for line in r.stdout.splitlines() if "| paged |" in line]
    assert len(paged) == 2 and all(line.split(" | ")[14].endswith("x") for line in paged)  # vs contiguous
    assert png.stat().st_size > 1000


def test_int4_table_takes_the_peer_rows_it_matches():
    """``add_peer`` puts tinygemm's times on the rows of the same linear, row count and group only; the table's
    speed-up is tinygemm's median over ours, and a peer error shows as such."""
    row = lambda name, m: {"name": name, "m": m, "k": 256, "n": 512, "int4_bytes": 65536 + 4096, "bf16_bytes": 262144,
                           "io_bytes": 2048, "seconds": {"bf16": [4e-6], "int4_kpacked": [2e-6, 3e-6, 2e-6]}}
    result = {"group_size": 64, "rows": [row("qkv", 1), row("qkv", 16), row("o", 1)], "xla_command_buffers": False}
    add_peer(result, [{"name": "qkv", "m": 1, "group_size": 64, "seconds": [5e-6]},
                      {"name": "qkv", "m": 16, "group_size": 128, "seconds": [9e-6]},  # another group: not ours
                      {"name": "o", "m": 1, "group_size": 64, "seconds": "ValueError: int4 needs K ..."}])
    assert [r["seconds"].get("tinygemm") for r in result["rows"]] == [[5e-6], None, "ValueError: int4 needs K ..."]
    table = int4_markdown(result, 1e12).splitlines()
    assert "XLA command buffers off" in table[0] and table[2].endswith("| int4_kpacked × tinygemm |")
    assert table[4].endswith("| 2.50× |") and table[5].endswith("| — | — |") and table[6].endswith("| error | — |")


def test_bench_int4_smoke_on_cpu(tmp_path):
    """The int4 scenario times the dequant-GEMM per linear shape (and the torch peer's tinygemm on the same
    shapes); e2e runs dense and int4 rows side by side, each with the torch peer's row of the same weights
    (``--peer torch``, here on the CPU, uncompiled)."""
    out = tmp_path / "bench.json"
    r = _bench("--scenarios", "int4,e2e", "--shape", "minicpm4-tiny", "--contexts", "24", "--attention_impls", "xla",
               "--quants", "none,int4", "--quant_group_size", "64", "--int4_ms", "1",
               "--int4_kernels", "auto,tile", "--decode_steps", "3", "--decode_block", "2", "--chunk_length", "32", "--dtype", "float32",
               "--repeats", "1", "--peer", "torch", "--peer_decode_steps", "2", "--json_out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["quant"] for row in result["rows"]] == ["none", "int4 g64"]
    assert all(row["decode_ms_per_token"][0] > 0 for row in result["rows"])
    rows = result["int4"]["rows"]
    assert [row["name"] for row in rows] == ["qkv", "o", "gate_up", "down"] and rows[0]["k"] == 256
    for row in rows:
        assert row["seconds"]["bf16"][0] > 0 and row["seconds"]["int4_kpacked"][0] > 0
        assert row["seconds"]["int4_kpacked_tile"][0] > 0 and row["config"]["kernel"] == "planes"
    assert "int4_kpacked_tile µs" in r.stdout
    # --peer torch with the int4 scenario: tinygemm on the same linears (group 64, one row), and our speed-up
    assert all(row["seconds"]["tinygemm"][0] > 0 for row in rows)
    assert [(p["name"], p["m"], p["group_size"]) for p in result["torch_linears"]["linears"]] == [
        (row["name"], 1, 64) for row in rows]
    assert "| int4_kpacked × tinygemm |" in r.stdout and "tinygemm µs (% BW, × bf16)" in r.stdout
    assert result["int4"]["xla_command_buffers"] is True and "XLA command buffers on" in r.stdout
    speedups = [line.rsplit("|", 2)[-2].strip() for line in r.stdout.splitlines() if line.startswith("| qkv | 1 |")]
    assert len(speedups) == 1 and speedups[0].endswith("×") and float(speedups[0][:-1]) > 0
    assert "| minicpm4-tiny | xla | int4 g64 | off | 1 | contiguous | 1 | 24 |" in r.stdout and "int4 dequant-GEMM, group 64" in r.stdout
    peer = result["torch_peer"]
    assert peer["device"] == "cpu" and [(p["quant"], p["context"]) for p in peer["rows"]] == [("none", 24), ("int4", 24)]
    assert "torch decode ms/token" in r.stdout and "torch peer: torch" in r.stdout
    table = [line for line in r.stdout.splitlines() if line.startswith("| minicpm4-tiny | xla |")]
    assert len(table) == 2
    assert all(f"{statistics.median(p['decode_ms_per_token']):.3f} |" in line for p, line in zip(peer["rows"], table))


def test_bench_tensor_parallel_smoke_on_cpu(tmp_path):
    """e2e rows per --tensor_parallel size (and size 1 through the sharded program), with the speed-up over
    one device; the collectives scenario times psum over the mesh (two of the conftest's CPU devices)."""
    out = tmp_path / "bench.json"
    r = _bench("--scenarios", "collectives,e2e", "--shape", "minicpm4-tiny", "--contexts", "24", "--attention_impls",
               "xla", "--tensor_parallel", "1,2", "--spmd_single", "--collective_bytes", "4096", "--decode_steps", "3",
               "--decode_block", "2", "--chunk_length", "32", "--dtype", "float32", "--repeats", "1",
               "--profile_collectives", "--json_out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(row["tensor_parallel"], row["spmd"]) for row in result["rows"]] == [(1, False), (2, True), (1, True)]
    assert result["rows"][1]["cache_bytes"] * 2 == result["rows"][0]["cache_bytes"]  # each device its KV heads
    assert all(row["decode_ms_per_token"][0] > 0 for row in result["rows"])
    [allreduce] = result["collectives"]
    assert allreduce["bytes"] == 4096 and allreduce["us"][0] > 0 and allreduce["bus_GBps"] > 0
    assert "| minicpm4-tiny | xla | none | off | 2 | contiguous | 1 | 24 |" in r.stdout and "| 1 (spmd) |" in r.stdout
    assert "all-reduce over 2 × cpu" in r.stdout


def test_bench_sparse_smoke_on_cpu(tmp_path):
    """The sparse scenario times dense and InfLLM-v2 attention of one layer (prefill and decode) and
    writes its tables; e2e takes --sparse_modes."""
    out = tmp_path / "bench.json"
    r = _bench("--scenarios", "sparse", "--shape", "minicpm4-tiny", "--sparse_prefill_contexts", "128",
               "--sparse_decode_contexts", "128", "--sparse_decode_layers", "2", "--chunk_length", "64",
               "--repeats", "1", "--json_out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())["sparse"]
    assert result["decode"][0]["layers"] == 2
    assert set(result["prefill"][0]["seconds"]) == {"dense", "sparse", "sparse_unsplit", "scores", "select", "select_xla_pool"}
    assert set(result["decode"][0]["seconds"]) == {"dense", "sparse", "sparse_unfused", "scores", "select",
                                                       "select_xla_pool", "stage2"}
    assert all(t[0] > 0 for t in result["decode"][0]["seconds"].values())
    assert result["decode"][0]["kernel_seconds"] == {"dense": None, "sparse": None}  # no GPU kernels on the CPU
    assert "| 128 | 64 |" in r.stdout and "| decode context | blocks attended |" in r.stdout
    assert "(pooled in the kernel / in XLA)" in r.stdout  # the pooling selection kernel beside XLA pooling
    bad = _bench("--sparse_modes", "maybe", timeout=300)
    assert bad.returncode == 2 and "unknown maybe" in bad.stderr


def test_bench_spec_smoke_on_cpu(tmp_path):
    """The spec scenario times verify forwards and oracle rounds, and the oracle forces the accept length."""
    out = tmp_path / "bench.json"
    r = _bench("--scenarios", "spec", "--shape", "minicpm4-tiny", "--spec_context", "48", "--spec_tree_sizes", "8",
               "--spec_oracle_tree_size", "12", "--spec_frspec_vocab", "512", "--decode_steps", "13", "--repeats", "1",
               "--spec_draft_quants", "int4", "--dtype", "float32", "--json_out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    spec = json.loads(out.read_text())["spec"]
    row = spec["rows"][0]
    assert spec["draft_quants"] == ["int4"] and row["oracle"][0]["draft_quant"] == "int4"
    assert row["verify"][0]["tree_size"] == 8 and row["verify"][0]["ms"][0] > 0 and len(row["verify"][0]["ms"]) == 3
    assert row["verify"][0]["vs_decode_step"] > 0
    # The forwards' kernels by name come from a GPU trace: none on the CPU (the loops still ran and carried).
    assert row["verify"][0]["kernels_us"] == {} and row["decode_forward_kernels_us"] == {}
    oracle = row["oracle"][0]
    assert oracle["mean_accept_length"] == 3.0 and oracle["frspec_vocab"] == 512
    # The traced round: every part of it found by its scope (how parts and idle make up the span:
    # test_scoped_seconds_splits_a_program_by_named_scope).
    split = oracle["split_ms"]
    assert set(split) == {"draft", "verify", "accept", "compact", "other", "idle"}
    assert min(split[k] for k in ("draft", "verify", "accept", "compact")) > 0, split
    assert oracle["traced_round_ms"] > 0 and split["idle"] >= 0
    assert oracle["verify_vs_decode_kernels"] > 0 and row["traced_plain_ms_per_token"]["kernels"] > 0
    assert "| none | int4 | 3.00 | 12 (512) |" in r.stdout
    # Every engine program holds at least the weights and cache it runs over (XLA's buffer assignment).
    model_programs = [v for k, v in row["program_bytes"].items() if k.split("/")[0] in ("prefill", "decode")]
    assert len(model_programs) == 2 and min(model_programs) >= row["weights_and_cache_bytes"] > 0, row
    assert max(oracle["program_bytes"].values()) >= oracle["weights_and_caches_bytes"] > row["weights_and_cache_bytes"]
    assert "| none | plain |" in r.stdout and "| none | speculative, accept 3.0, int4 draft |" in r.stdout


def test_plot_from_saved_json(tmp_path):
    result = {
        "device": "test", "shape": "minicpm4-8b",
        "rows": [{"attention_impl": impl, "context": c, "decode_ms_per_token": [ms, ms]}
                 for impl, base in (("pallas", 6.5), ("xla", 6.6)) for c, ms in ((1024, base), (32768, base + 0.5))],
        "peer": {"rows": [{"attn": "eager", "context": 1024, "decode_ms_per_token": [70.0], "prefill_tok_s": [1.0]},
                          {"attn": "eager", "context": 32768, "decode_ms_per_token": [], "prefill_tok_s": [],
                           "error": "out of GPU memory"}]},
    }
    src = tmp_path / "r.json"
    src.write_text(json.dumps(result))
    png = tmp_path / "p.png"
    r = _bench("--plot_from", str(src), "--plot", str(png), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,message", [
    (["--scenarios", "e2e,warp"], "unknown warp"),
    (["--attention_impls", "cuda"], "unknown cuda"),
    (["--quants", "int8"], "unknown int8"),
    (["--spec_draft_quants", "int8"], "--spec_draft_quants: unknown int8"),
    (["--peer", "hf,tensorrt"], "--peer: unknown tensorrt"),
    (["--int4_kernels", "auto,marlin_asm"], "unknown marlin_asm"),
    (["--quant_group_size", "24"], "multiple of 16"),
    (["--contexts", "1k"], "--contexts must be integers"),
    (["--plot_from", "/nonexistent.json", "--plot", "x.png"], "cannot read /nonexistent.json"),
    (["--scenarios", "e2e", "--contexts", "4000", "--max_length", "1000", "--shape", "smollm2-135m"],
     "too small"),
])
def test_bench_rejects_bad_flags(args, message):
    r = _bench(*args, timeout=300)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_hf_peer_rows_on_cpu():
    """The HF peer's measuring loop (run on the GPU by --peer hf) on a small shape on the CPU."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "benchmarks.hf_peer", "--shape", "minicpm4-tiny", "--contexts", "16,24",
                        "--decode_steps", "3", "--attn", "eager,sdpa", "--repeats", "2", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(row["attn"], row["context"]) for row in result["rows"]] == [("eager", 16), ("eager", 24), ("sdpa", 16), ("sdpa", 24)]
    for row in result["rows"]:
        assert row["error"] is None and len(row["decode_ms_per_token"]) == 2 and min(row["prefill_tok_s"]) > 0


def _oracle_run(k: float, max_new_tokens: int):
    """A random tiny target and draft decoding under ``oracle_accept(k)``: (stats summary, spec)."""
    config = ModelConfig.from_dict(tiny_minicpm_config(vocab_size=64))
    max_length = 16 + max_new_tokens + 64
    model = MiniCPMForCausalLM(config, max_length=max_length, attention_impl="xla", dtype=jnp.float32,
                               rngs=nnx.Rngs(0))
    draft = EagleDraft(DraftSpec.for_target(config), max_length=max_length, attention_impl="xla", dtype=jnp.float32,
                       rngs=nnx.Rngs(1))
    spec = SpecConfig(num_iter=3, topk_per_iter=4, tree_size=16)
    steps = EagleSteps(model, draft, spec=spec, batch_size=1, decode_block=4, accept=oracle_accept(k, spec))
    engine = Engine(model, batch_size=1, chunk_length=16, decode_block=4, steps=steps)
    _, stats = engine.generate([[3, 9, 17, 4, 22, 5]], max_new_tokens=max_new_tokens)
    return stats.as_dict(), spec


def test_oracle_rule_accepts_exactly_k():
    """The spec scenario's acceptance rule (composed into the engine's step set by the benchmark) accepts
    the draft's best chain to depth K-1 whatever the tokens: a random draft over a random target still
    emits K tokens every round; K outside 1..num_iter+1 is refused."""
    summary, spec = _oracle_run(3, 31)
    assert summary["mean_accept_length"] == 3.0 and summary["spec_rounds"] == 10
    assert summary["depth_acceptance"] == [1.0, 1.0, 0.0]
    for k in (0, 5, 4.5):
        with pytest.raises(MiniCPMError, match="spec_oracle_accept"):
            oracle_accept(k, spec)


def test_oracle_rule_fractional_accept_mixes_floor_and_ceil_rounds():
    """A fractional accept length (CPM.cu publishes 2.5) accepts 2 or 3 tokens a round, never another
    count, with both kinds of rounds occurring, so the measured mean lies strictly between."""
    summary, _ = _oracle_run(2.5, 90)
    depth = summary["depth_acceptance"]  # share of rounds accepting a node at depth 1, 2, 3
    assert depth[0] == 1.0 and 0.0 < depth[1] < 1.0 and depth[2] == 0.0, depth
    assert 2.0 < summary["mean_accept_length"] < 3.0
