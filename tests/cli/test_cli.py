"""``python -m minicpm_jax.run`` as a user runs it: the demo model, JSON, streaming, chat, bad input."""

import json
import os
import subprocess
import sys
import time

import pytest

RUN = [sys.executable, "-m", "minicpm_jax.run"]


def _run(*args, stdin=None, timeout=600):
    return subprocess.run(RUN + list(args), capture_output=True, text=True, input=stdin, timeout=timeout, env=os.environ)


def _assert_one_line_error(r, message):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and message in lines[0], r.stderr


@pytest.mark.smollm2
def test_demo_answers_and_prints_stats(smollm2_dir):
    r = _run("--prompt_text", "What is the capital of France?", "--num_generate", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    for line in ("Performance Summary", "Prefill length", "Prefill speed", "Decode length", "Decode speed"):
        assert line in r.stderr and line not in r.stdout  # text on stdout, diagnostics on stderr
    assert "Traceback" not in r.stderr


@pytest.mark.smollm2
def test_json_output(smollm2_dir):
    r = _run("--prompt_text", "What is the capital of France?", "--num_generate", "24", "--json_output", "--seed", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # stdout holds the JSON object and nothing else
    assert "Paris" in out["text"] and out["finish_reason"] in ("stop", "length") and out["seed"] == 3
    assert out["completion_tokens"] == len(out["token_ids"]) <= 24 and out["prompt_tokens"] > 10
    stats = out["stats"]
    assert stats["prefill_tokens"] == out["prompt_tokens"] and stats["decode_tokens"] == out["completion_tokens"] - 1
    assert stats["decode_tokens_per_s"] > 0 and stats["prefill_tokens_per_s"] > 0


@pytest.mark.smollm2
def test_stream_prints_incrementally(smollm2_dir):
    proc = subprocess.Popen(
        RUN + ["--prompt_text", "Count from 1 to 20, one number per line.", "--num_generate", "60",
               "--decode_block", "2", "--plain_output"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
    )
    arrivals = []
    for line in proc.stdout:
        arrivals.append((time.perf_counter(), line))
    proc.wait(timeout=600)
    ended = time.perf_counter()
    assert proc.returncode == 0, proc.stderr.read()
    text_lines = [t for t, line in arrivals if line.strip()]
    assert len(text_lines) >= 5 and not any(line.startswith("Prefill length") for _, line in arrivals)
    assert "Prefill length" in proc.stderr.read()  # the plain stats lines, on stderr
    # The numbers arrived one by one while decoding, well before the end.
    assert text_lines[-1] - text_lines[0] > 0.05
    assert ended - text_lines[0] > 0.05


@pytest.mark.smollm2
def test_stop_string_cuts_output(smollm2_dir):
    r = _run("--prompt_text", "Count from 1 to 20, one number per line.", "--num_generate", "60", "--stop", "5",
             "--json_output")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop" and "5" not in out["text"] and "4" in out["text"]


@pytest.mark.smollm2
def test_interactive_chat_reuses_the_cache(smollm2_dir):
    r = _run("--interactive", "--plain_output", "--num_generate", "32",
             stdin="What is the capital of France?\nAnd what is the capital of Germany?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "Berlin" in r.stdout
    prefill = [int(line.split()[2]) for line in r.stderr.splitlines() if line.startswith("Prefill length")]
    assert len(prefill) == 2 and prefill[1] < 25 < prefill[0]  # turn 2 prefills only its new tokens


def _reader(stream, into: list):
    """Collects a child's output as it comes (a thread), so the test can wait for it without blocking."""
    import threading

    def read():
        for ch in iter(lambda: stream.read(1), ""):
            into.append(ch)

    threading.Thread(target=read, daemon=True).start()


@pytest.mark.smollm2
def test_ctrl_c_in_interactive_stops_the_reply_not_the_chat(smollm2_dir):
    """Ctrl-C while a reply streams ends that reply; the chat goes on and answers the next message."""
    import signal

    proc = subprocess.Popen(RUN + ["--interactive", "--plain_output", "--num_generate", "120", "--ignore_eos",
                                   "--decode_block", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ)
    out, err = [], []
    _reader(proc.stdout, out)
    _reader(proc.stderr, err)
    proc.stdin.write("Tell me a long story about a dragon.\n")
    proc.stdin.flush()
    deadline = time.time() + 300
    while not out and time.time() < deadline:
        time.sleep(0.1)
    assert out, "".join(err)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    while "(interrupted)" not in "".join(err) and time.time() < deadline:
        time.sleep(0.1)
    first_reply = len(out)
    proc.stdin.write("What is the capital of France?\n/exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=300) == 0, "".join(err)
    time.sleep(0.2)
    assert "(interrupted)" in "".join(err) and "Traceback" not in "".join(err)
    assert "Paris" in "".join(out[first_reply:])


@pytest.mark.smollm2
def test_ctrl_c_while_loading_ends_the_run(smollm2_dir):
    """Ctrl-C during imports and model loading ends the run at once with one line (it was sometimes
    swallowed by a garbage-collection callback and the run went on)."""
    import signal

    proc = subprocess.Popen(RUN + ["--prompt_text", "Hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err


def test_unknown_flag():
    _assert_one_line_error(_run("--no_such_flag=1"), "Unknown command line flag 'no_such_flag'")


def test_missing_model_path(tmp_path):
    _assert_one_line_error(_run("--model_path", str(tmp_path / "nope")), "does not exist")


def test_directory_without_config(tmp_path):
    _assert_one_line_error(_run("--model_path", str(tmp_path)), "no config.json in")


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "temperature must be >= 0"),
    ("--top_p", "1.5", "top_p must be in (0, 1]"),
    ("--top_k", "-3", "top_k must be >= 0"),
    ("--max_length", "0", "--max_length must be >= 2"),
    ("--max_length", "lots", "--max_length must be a number of tokens or auto"),
    ("--memory_limit", "0", "--memory_limit must be in (0, 1]"),
])
def test_bad_generation_flags(flag, value, message):
    _assert_one_line_error(_run(flag, value), message)


def test_missing_prompt_file(tmp_path):
    _assert_one_line_error(_run("--prompt_file", str(tmp_path / "p.txt")), "--prompt_file")


def test_empty_prompt_is_refused_before_loading(tmp_path):
    _assert_one_line_error(_run("--prompt_text", ""), "the prompt is empty (--prompt_text)")
    (tmp_path / "p.txt").write_text(" \n")
    _assert_one_line_error(_run("--prompt_file", str(tmp_path / "p.txt")), "the prompt is empty (--prompt_file")


@pytest.mark.smollm2
def test_cache_past_the_model_positions_is_one_line_before_loading(smollm2_dir):
    """SmolLM2 has 8192 positions and no rope scaling: a 5M-token cache is refused with the fix (it was an
    XLA out-of-memory traceback)."""
    _assert_one_line_error(_run("--max_length", "5000000", "--prompt_text", "hi"),
                           "max_length 5000000 exceeds the 8192 positions this model supports")


@pytest.mark.smollm2
def test_prompt_longer_than_context(smollm2_2_layers_dir):
    # Refused once the prompt is tokenized, after loading: the demo model cut to two layers loads faster.
    r = _run("--model_path", smollm2_2_layers_dir, "--prompt_text", "word " * 300, "--max_length", "128")
    _assert_one_line_error(r, "max_length is 128")


@pytest.mark.smollm2
def test_pallas_attention_flag_gives_the_xla_tokens(smollm2_2_layers_dir):
    """--attention_impl pallas (interpret mode on the CPU) answers token for token like the reference. On
    the demo model cut to two layers (its heads, head size, vocabulary and tokenizer, its first layers'
    weights): the same kernels and programs per layer as the 30-layer model, which the interpret mode took
    a minute to compile; all 8 tokens are compared (--ignore_eos)."""
    outs = {}
    for impl in ("pallas", "xla"):
        r = _run("--model_path", smollm2_2_layers_dir, "--prompt_text", "What is the capital of France?",
                 "--num_generate", "8", "--ignore_eos", "--max_length", "64", "--chunk_length", "64",
                 "--attention_impl", impl, "--json_output")  # 37 prompt tokens
        assert r.returncode == 0, r.stderr
        outs[impl] = json.loads(r.stdout)
        assert outs[impl]["attention_impl"] == impl
        assert ("interpret mode" in r.stderr) == (impl == "pallas")  # the slow path is announced
    assert outs["pallas"]["token_ids"] == outs["xla"]["token_ids"]
    assert outs["pallas"]["prompt_tokens"] == 37 and len(outs["pallas"]["token_ids"]) == 8
    assert len(set(outs["pallas"]["token_ids"])) > 1  # not one token repeated: the attention sees the context


@pytest.mark.smollm2
def test_sparse_flags_reach_the_model(smollm2_2_layers_dir):
    """--sparse on for a checkpoint without sparse_config (MiniCPM4 defaults, overridden by flags): the
    sparse path runs from token 16 on; with 64-token blocks all of this short prompt stays selected, so
    the answer is the dense one token for token (the demo model cut to two layers: the flags' path, not
    the answer's quality, is the point)."""
    common = ("--model_path", smollm2_2_layers_dir, "--prompt_text", "What is the capital of France?",
              "--num_generate", "8", "--ignore_eos", "--max_length", "256", "--chunk_length", "64", "--json_output")
    r = _run(*common, "--sparse", "on", "--sparse_topk", "2", "--sparse_window", "128", "--dense_len", "16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sparse"] == "topk 2 + window 128 (4 blocks of 64) from 16 tokens"
    dense = _run(*common)
    assert dense.returncode == 0, dense.stderr
    assert json.loads(dense.stdout)["sparse"] == "off"
    assert out["token_ids"] == json.loads(dense.stdout)["token_ids"] and len(out["token_ids"]) == 8


@pytest.mark.parametrize("flag, value, message", [
    ("--sparse_topk", "0", "topk must be >= 1"),
    ("--dense_len", "-3", "dense_len must be >= -1"),
    ("--sparse", "sometimes", "sparse"),
])
def test_bad_sparse_flags(flag, value, message):
    _assert_one_line_error(_run("--sparse", "on", flag, value) if flag != "--sparse" else _run(flag, value), message)


def test_bad_attention_impl():
    _assert_one_line_error(_run("--attention_impl", "cuda"), "attention_impl")


def test_bad_tp_all_reduce():
    _assert_one_line_error(_run("--tp_all_reduce", "mpi"), "tp_all_reduce")


def test_speculative_run_with_the_shipped_draft_gives_the_plain_greedy_text(smollm2_dir):
    """SmolLM2 with the EAGLE-2 draft shipped for it (``--draft_path demo``, trained by
    ``minicpm_jax.train_eagle``): greedy speculative output is the plain greedy output, and most rounds
    accept drafted tokens (a random draft accepts about none: mean 1.0)."""
    common = ("--prompt_text", "What is the capital of France?", "--num_generate", "12", "--max_length", "256",
              "--chunk_length", "64", "--json_output")
    plain = _run(*common)
    spec = _run(*common, "--draft_path", "demo", "--spec_num_iter", "3", "--spec_tree_size", "16")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    plain_out, spec_out = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec_out["text"] == plain_out["text"] and "Paris" in spec_out["text"]
    assert plain_out["speculative"] == "off"
    assert spec_out["speculative"] == "llama EAGLE draft, tree 16 (3 steps x top-10), window 1024, full vocabulary"
    assert spec_out["stats"]["spec_rounds"] >= 1 and spec_out["stats"]["mean_accept_length"] >= 1.8
    assert len(spec_out["stats"]["depth_acceptance"]) == 3


@pytest.mark.parametrize("args, message", [
    (("--draft_path", "/nonexistent/draft"), "is not a directory"),
    (("--frspec_path", "/tmp"), "needs --draft_path"),
    (("--draft_path", "demo", "--model_path", "/tmp"), "omit --model_path"),
    (("--draft_path", "/tmp", "--spec_tree_size", "65"), "spec_tree_size"),
])
def test_bad_speculative_flags(args, message):
    _assert_one_line_error(_run(*args), message)
