"""Benchmarks: ``python -m benchmarks --scenarios kernels,e2e --shape minicpm4-8b`` (from a checkout).

Every number is printed next to the ceiling it is measured against, taken in the same run: a
device-to-device copy (memory-bound rows) or a large bf16 matmul (compute-bound rows), each the faster of
XLA's and PyTorch's (``copy_``, ``torch.mm``; measured by ``benchmarks.torch_peer --rooflines_only`` in a
subprocess on a GPU), so that no row reads above its roofline.

Scenarios (``--scenarios``, comma-separated):

* ``kernels`` — attention micro-benchmarks at the shape's attention dims (bf16, batch 1): causal prefill
  of a whole prompt (``--prefill_contexts``; TFLOP/s vs the matmul) and one-token decode against a cache
  (``--decode_contexts``; GB/s of the K/V bytes that must be read vs the copy bandwidth), for the Pallas
  kernels, the plain-XLA reference and cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``).
  Kernels are timed as many calls inside one jit (µs-scale), two timed repeats after a warm-up.
* ``e2e`` — the real engine (chunked prefill, on-device decode loop) on the named shape with random
  weights, per ``--attention_impls`` and ``--contexts``: decode ms/token vs (weights + valid K/V bytes) /
  copy bandwidth, prefill tok/s vs FLOPs per token (2 per matmul weight plus causal attention,
  2·layers·heads·head_dim·(context+1) on average) / matmul FLOP/s. All contexts share one
  static cache (``--max_length``), so rows show how cost follows the actual context.
* ``load`` — ``load_model`` of the shape's random weights from HF safetensors vs the native format.
* ``int4`` — the W4A16 dequant-GEMM (``pallas_kernels.int4_matmul``) on every linear shape of the model
  at ``--int4_ms`` rows, against bf16 ``jnp.dot`` and the copy bandwidth (see ``benchmarks.int4``). e2e rows for int4 weights come from ``--quants none,int4`` (random int4 weights,
  group ``--quant_group_size``; the decode roofline then counts int4 codes + scales).

* ``spec`` — EAGLE speculative decoding at ``--spec_context``: tree-verify cost vs a plain decode
  step for ``--spec_tree_sizes``, and oracle-draft rounds (``--spec_oracle_accept K``: exactly K tokens a
  round) against plain decode, for each of ``--quants``, with the draft / verify / compact split (see
  ``benchmarks.spec``).
* ``sparse`` — InfLLM-v2 attention of one layer against the dense Pallas kernels: the whole prefill of
  ``--sparse_prefill_contexts`` prompts in ``--chunk_length`` chunks, and one-token decode at
  ``--sparse_decode_contexts`` (see ``benchmarks.sparse``). e2e rows with sparse attention come from
  ``--sparse_modes off,on`` (the shape's sparse_config, else MiniCPM4's), with the KV + compressed cache
  bytes and the peak GPU memory.

* ``collectives`` — the all-reduce of tensor parallelism alone (``psum`` in ``shard_map`` over the largest
  ``--tensor_parallel`` size): µs per call at the decode step's message sizes and the bus bandwidth at
  large ones (see ``benchmarks.collectives``).

e2e rows run for each ``--tensor_parallel`` size (the model split over that many devices; ``--spmd_single``
adds size 1 through the sharded program, to price the SPMD path on one device), with the speed-up over
size 1 and, with ``--profile_collectives``, the collectives' kernel time per layer from a profile.

``--peer hf`` first runs HF transformers (PyTorch, same GPU, same shape, random weights; see
``benchmarks.hf_peer``) on the e2e contexts, in a subprocess before JAX takes the GPU, and adds its rows and our
ratio to it; ``--peer torch`` (or ``hf,torch``) likewise a gpt-fast-style PyTorch decoder, bf16 and tinygemm
int4 per ``--quants`` (``benchmarks.torch_peer``), and with the ``int4`` scenario tinygemm on every linear
shape and ``--int4_ms`` row count (a ``tinygemm`` column and our kernel's speed-up over it). Writes JSON (``--json_out``) and markdown (``--markdown_out``); prints the markdown last;
``--plot out.png`` draws decode ms/token against context (needs matplotlib; ``--plot_from`` re-plots a
saved JSON without a GPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.collectives import DEFAULT_SIZES, bench_allreduce, collectives_markdown
from benchmarks.e2e import bench_end_to_end, markdown, run_hf_peer, run_peer, run_torch_peer
from benchmarks.int4 import add_peer, bench_int4, int4_markdown
from benchmarks.kernels import bench_kernels, kernels_markdown
from benchmarks.load import bench_load, load_markdown
from benchmarks.plot import plot
from benchmarks.shapes import SHAPES, copy_bandwidth, matmul_flops, random_model
from benchmarks.sparse import bench_sparse, sparse_markdown
from benchmarks.spec import bench_speculative, spec_markdown
from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.attention import ATTENTION_CHOICES
from minicpm_jax.quant import QuantSpec
from pallas_kernels.int4_matmul import KERNELS as INT4_KERNELS

FLAGS = flags.FLAGS
SCENARIOS = ("e2e", "kernels", "load", "int4", "sparse", "spec", "collectives")
flags.DEFINE_list("scenarios", ["e2e"], "Which benchmarks: e2e (prefill + decode), kernels (attention), load, "
                  "int4 (dequant-GEMM), sparse (InfLLM-v2 attention vs dense).")
flags.DEFINE_enum("shape", "minicpm4-8b", list(SHAPES), "Model shape (random weights).")
flags.DEFINE_string("scratch_dir", "/tmp/minicpm_jax_bench", "Where the load scenario writes its checkpoints.")
flags.DEFINE_list("contexts", ["1024"], "e2e: context lengths (prompt tokens before decoding).")
flags.DEFINE_list("attention_impls", ["auto"], "e2e: kernel backends to run (auto, pallas, xla), one row each.")
flags.DEFINE_list("quants", ["none"], "e2e: weight formats to run (none = dense --dtype, int4 = W4A16), one row each.")
flags.DEFINE_integer("quant_group_size", 128, "e2e and int4: int4 scale group size.")
flags.DEFINE_list("int4_ms", ["1", "16", "64"], "int4: activation rows (1 = decode GEMV; 16/64 = tree verify, batches).")
flags.DEFINE_list("int4_kernels", ["auto"], "int4: kernels to time (auto = what the model runs; tile, planes, "
                  "planes_t = pallas_kernels.int4_matmul.KERNELS).")
flags.DEFINE_list("sparse_modes", ["off"], "e2e: InfLLM-v2 modes to run (off = dense attention, on = the checkpoint's "
                  "or MiniCPM4's sparse_config), one row each.")
flags.DEFINE_list("sparse_prefill_contexts", ["32768", "65536", "131072"], "sparse: prompt lengths.")
flags.DEFINE_list("sparse_decode_contexts", ["8192", "32768", "131072"], "sparse: cache lengths for decode.")
flags.DEFINE_integer("sparse_decode_layers", 0, "sparse: layers per timed decode loop iteration (0 = 8 to 16, "
                     "enough that the K/V reads never come from L2; fewer compile faster).", lower_bound=0)
flags.DEFINE_integer("spec_context", 1024, "spec: context length of the speculative rows.")
flags.DEFINE_list("spec_tree_sizes", ["16", "32", "64"], "spec: tree sizes of the verify rows (the largest is used for "
                  "the oracle rounds).")
flags.DEFINE_list("spec_oracle_accept", ["3"], "spec: accept lengths forced by the oracle draft (tokens per round; "
                  "a fraction such as 2.5 mixes rounds of 2 and 3).")
flags.DEFINE_enum("spec_sparse", "off", ["off", "on"], "spec: the target's InfLLM-v2 mode (on: the shape's sparse "
                  "settings, e.g. int4 + InfLLM-v2 + EAGLE at --spec_context 131072, CPM.cu's headline stack).")
flags.DEFINE_integer("spec_oracle_tree_size", 32, "spec: tree nodes of the oracle rounds.")
flags.DEFINE_integer("spec_frspec_vocab", 32768, "spec: FR-Spec draft vocabulary of the oracle rounds (0 = full).")
flags.DEFINE_list("spec_draft_quants", ["none"], "spec: the random drafts of the oracle rows: none (bf16) and/or int4 "
                  "(fc and layer linears at --quant_group_size, as CPM.cu's headline stack runs its QAT draft).")
flags.DEFINE_list("prefill_contexts", ["2048", "8192", "32768"], "kernels: causal prompt lengths.")
flags.DEFINE_list("decode_contexts", ["1024", "8192", "32768", "131072"], "kernels: cache lengths for decode.")
flags.DEFINE_integer("decode_kernel_layers", 0, "kernels: layers' caches per timed decode call (0 = enough to stream "
                     "past L2, at most 32; fewer compile faster).", lower_bound=0)
flags.DEFINE_list("tensor_parallel", ["1"], "e2e: device counts to split the model over (tensor parallelism), one row "
                  "set each; collectives: the largest is the mesh.")
flags.DEFINE_boolean("spmd_single", False, "e2e: also run size 1 through the sharded (SPMD) program.")
flags.DEFINE_boolean("profile_collectives", False, "e2e: profile the decode loop of split models and report the "
                     "collectives' kernel time per layer.")
flags.DEFINE_list("collective_bytes", [str(n) for n in DEFAULT_SIZES], "collectives: message sizes in bytes.")
flags.DEFINE_list("kv_caches", ["contiguous"], "e2e: KV cache layouts to run (contiguous = a max_length row per "
                  "sequence; paged = the server's pool of 64-token pages read through page tables), one row each.")
flags.DEFINE_integer("batch_size", 1, "Sequences decoded together.")
flags.DEFINE_integer("decode_steps", 128, "Tokens decoded per timed run.")
flags.DEFINE_integer("decode_block", 32, "Decode steps per host round trip.")
flags.DEFINE_enum("tp_all_reduce", "auto", ["auto", "peer", "xla", "nccl"], "e2e: the all-reduce of split models, "
                  "as run's flag (auto: peer on the GPUs of one process, else xla).")
flags.DEFINE_integer("chunk_length", 1024, "Prefill chunk length.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Weight/activation dtype.")
flags.DEFINE_integer("repeats", 2, "Timed repeats per row (all are reported, to show the spread).")
flags.DEFINE_integer("max_length", None, "Static cache length (default: largest context + decode_steps + 8).")
flags.DEFINE_list("peer", [], "Also run these peers on the e2e rows: hf (transformers on the GPU), torch (a "
                  "gpt-fast-style PyTorch decoder: static cache, CUDA graphs, tinygemm int4; with the int4 scenario "
                  "also tinygemm per linear); none = no peer.")
flags.DEFINE_list("peer_attn", ["eager", "sdpa"], "HF attn_implementation values to run with --peer hf.")
flags.DEFINE_integer("peer_decode_steps", 32, "Tokens the HF peer decodes per timed run.")
flags.DEFINE_boolean("xla_command_buffers", True, "CUDA graphs for while/conditional bodies, as run and server "
                     "use (minicpm_jax.cli.system).")
flags.DEFINE_string("json_out", None, "Write all results as JSON here.")
flags.DEFINE_string("markdown_out", None, "Write the markdown tables here.")
flags.DEFINE_string("plot", None, "Draw decode ms/token vs context (e2e rows, kernels' decode rows) to this PNG.")
flags.DEFINE_string("plot_from", None, "Only re-draw --plot from this saved --json_out file (no benchmarks run).")
flags.DEFINE_string("dump_hlo", None, "Write the optimized HLO of the decode block to this file.")


def main(argv):
    del argv
    if FLAGS.xla_command_buffers:
        from minicpm_jax.cli.system import enable_command_buffers

        enable_command_buffers()
    if FLAGS.tp_all_reduce == "nccl":
        from minicpm_jax.cli.system import use_nccl_all_reduce

        use_nccl_all_reduce()
    try:
        _main()
    except MiniCPMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _int_list(name: str, values: list[str]) -> list[int]:
    return _number_list(name, values, int)


def _float_list(name: str, values: list[str]) -> list[float]:
    return _number_list(name, values, float)


def _number_list(name: str, values: list[str], kind) -> list:
    """``values`` as ``kind`` (int or float), each at least 1; MiniCPMError naming the flag otherwise."""
    try:
        out = [kind(v) for v in values]
    except ValueError:
        raise MiniCPMError(f"--{name} must be {'integers' if kind is int else 'numbers'}, got {','.join(values)}") from None
    if any(v < 1 for v in out):
        raise MiniCPMError(f"--{name} must be positive, got {','.join(values)}")
    return out


def _main():
    if FLAGS.plot_from:
        if not FLAGS.plot:
            raise MiniCPMError("--plot_from needs --plot OUT.png")
        try:
            with open(FLAGS.plot_from) as f:
                plot(json.load(f), FLAGS.plot)
        except (OSError, json.JSONDecodeError) as e:
            raise MiniCPMError(f"cannot read {FLAGS.plot_from}: {e}") from None
        print(f"wrote {FLAGS.plot}")
        return
    contexts = _int_list("contexts", FLAGS.contexts)
    unknown = set(FLAGS.scenarios) - set(SCENARIOS)
    if unknown:
        raise MiniCPMError(f"--scenarios: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SCENARIOS)})")
    for name in ("quants", "spec_draft_quants"):
        bad_quant = set(getattr(FLAGS, name)) - {"none", "int4"}
        if bad_quant or not getattr(FLAGS, name):
            raise MiniCPMError(f"--{name}: unknown {', '.join(sorted(bad_quant)) or 'empty list'} (choose from none, "
                               "int4)")
    quant_spec = QuantSpec(group_size=FLAGS.quant_group_size)
    bad_kernel = set(FLAGS.int4_kernels) - {"auto", *INT4_KERNELS}
    if bad_kernel:
        raise MiniCPMError(f"--int4_kernels: unknown {', '.join(sorted(bad_kernel))} (choose from auto, "
                           f"{', '.join(INT4_KERNELS)})")
    bad_sparse = set(FLAGS.sparse_modes) - {"off", "on", "auto"}
    if bad_sparse:
        raise MiniCPMError(f"--sparse_modes: unknown {', '.join(sorted(bad_sparse))} (choose from off, on, auto)")
    bad_impl = set(FLAGS.attention_impls) - set(ATTENTION_CHOICES)
    if bad_impl:
        raise MiniCPMError(f"--attention_impls: unknown {', '.join(sorted(bad_impl))} (choose from "
                           f"{', '.join(ATTENTION_CHOICES)})")
    if FLAGS.max_length and "e2e" in FLAGS.scenarios and FLAGS.max_length < max(contexts) + FLAGS.decode_steps:
        raise MiniCPMError(f"--max_length {FLAGS.max_length} is too small for context {max(contexts)} + "
                           f"{FLAGS.decode_steps} steps")
    result: dict = {"shape": FLAGS.shape, "argv": sys.argv[1:]}
    peers = [p for p in FLAGS.peer if p != "none"]
    if set(peers) - {"hf", "torch"}:
        raise MiniCPMError(f"--peer: unknown {', '.join(sorted(set(peers) - {'hf', 'torch'}))} (choose from hf, torch)")
    if "hf" in peers:  # before JAX allocates GPU memory
        result["peer"] = run_hf_peer(FLAGS.shape, contexts, FLAGS.peer_decode_steps, FLAGS.peer_attn, FLAGS.repeats)
    if "torch" in peers and "e2e" in FLAGS.scenarios:
        quants = [q for q in FLAGS.quants if q in ("none", "int4")]
        result["torch_peer"] = run_torch_peer(FLAGS.shape, contexts, FLAGS.peer_decode_steps, quants, FLAGS.repeats,
                                              FLAGS.quant_group_size)
    if "torch" in peers and "int4" in FLAGS.scenarios:
        ms = ",".join(map(str, _int_list("int4_ms", FLAGS.int4_ms)))
        result["torch_linears"] = run_peer("benchmarks.torch_peer", [
            "--shape", FLAGS.shape, "--linears_ms", ms, "--group_size", str(FLAGS.quant_group_size),
            "--repeats", str(FLAGS.repeats)])
    device = jax.devices()[0].device_kind
    result.update(device=device, jax=jax.__version__)
    tables = []
    dtype = jnp.dtype(FLAGS.dtype)
    if {"e2e", "kernels", "int4"} & set(FLAGS.scenarios):
        small = jax.default_backend() == "cpu"  # CPU numbers are for smoke runs only
        jax_copy = copy_bandwidth(256 * 1024**2 if small else 2 * 1024**3)
        jax_flops = matmul_flops(1024 if small else 8192)
        torch_ceilings = {} if small else torch_rooflines(result.get("torch_peer") or result.get("torch_linears"))
        # Each roofline is the fastest measured here, by XLA or by PyTorch: a row that beats it is wrong.
        bandwidth, copy_source = max((jax_copy, "XLA copy"), (torch_ceilings.get("copy_bandwidth_Bps", 0.0), "torch copy_"))
        flops, matmul_source = max((jax_flops, "XLA dot"), (torch_ceilings.get("matmul_flops", 0.0), "torch.mm"))
        result.update(copy_bandwidth_Bps=bandwidth, copy_source=copy_source, jax_copy_Bps=jax_copy,
                      torch_copy_Bps=torch_ceilings.get("copy_bandwidth_Bps"), matmul_flops=flops,
                      matmul_source=matmul_source, jax_matmul_flops=jax_flops,
                      torch_matmul_flops=torch_ceilings.get("matmul_flops"))
    if "load" in FLAGS.scenarios:
        result["load"] = bench_load(FLAGS.shape, FLAGS.scratch_dir, dtype, FLAGS.repeats)
        tables.append(load_markdown(result["load"]))
    if "kernels" in FLAGS.scenarios:
        result["kernels"] = bench_kernels(FLAGS.shape, _int_list("prefill_contexts", FLAGS.prefill_contexts),
                                          _int_list("decode_contexts", FLAGS.decode_contexts), dtype, FLAGS.repeats,
                                          FLAGS.decode_kernel_layers)
        tables.append(kernels_markdown(result["kernels"], bandwidth, flops))
    if "int4" in FLAGS.scenarios:
        config = ModelConfig.from_dict(SHAPES[FLAGS.shape])
        result["int4"] = bench_int4(config, _int_list("int4_ms", FLAGS.int4_ms), quant_spec.group_size, FLAGS.repeats,
                                    kernels=tuple(FLAGS.int4_kernels))
        result["int4"]["xla_command_buffers"] = FLAGS.xla_command_buffers
        if "torch_linears" in result:
            add_peer(result["int4"], result["torch_linears"]["linears"])
        tables.append(int4_markdown(result["int4"], bandwidth))
    if "sparse" in FLAGS.scenarios:
        config = ModelConfig.from_dict(SHAPES[FLAGS.shape])
        result["sparse"] = bench_sparse(config, config.sparse or SparseConfig(),
                                        _int_list("sparse_prefill_contexts", FLAGS.sparse_prefill_contexts),
                                        _int_list("sparse_decode_contexts", FLAGS.sparse_decode_contexts),
                                        FLAGS.chunk_length, dtype, FLAGS.repeats, FLAGS.sparse_decode_layers)
        tables.append(sparse_markdown(result["sparse"]))
    if "spec" in FLAGS.scenarios:
        result["spec"] = bench_speculative(ModelConfig.from_dict(SHAPES[FLAGS.shape]), FLAGS.spec_context,
                                           _int_list("spec_tree_sizes", FLAGS.spec_tree_sizes),
                                           _float_list("spec_oracle_accept", FLAGS.spec_oracle_accept), FLAGS.quants,
                                           quant_spec.group_size, dtype, FLAGS.decode_steps, FLAGS.repeats,
                                           random_model, FLAGS.spec_oracle_tree_size, FLAGS.spec_frspec_vocab,
                                           FLAGS.spec_sparse, tuple(FLAGS.spec_draft_quants))
        tables.append(spec_markdown(result["spec"]))
    sizes = _int_list("tensor_parallel", FLAGS.tensor_parallel)
    if "collectives" in FLAGS.scenarios:
        result["collectives"] = bench_allreduce(max(sizes), _int_list("collective_bytes", FLAGS.collective_bytes),
                                                FLAGS.repeats)
        tables.append(collectives_markdown(max(sizes), result["collectives"], device))
    if "e2e" in FLAGS.scenarios:
        rows = []
        dump_hlo = FLAGS.dump_hlo
        runs = [(n, n > 1) for n in sizes] + ([(1, True)] if FLAGS.spmd_single else [])
        for quant in FLAGS.quants:
            for impl in FLAGS.attention_impls:
                for sparse in FLAGS.sparse_modes:
                    for n, spmd in runs:
                        for kv in FLAGS.kv_caches:
                            rows += bench_end_to_end(FLAGS.shape, contexts, FLAGS.batch_size, FLAGS.decode_steps,
                                                     FLAGS.decode_block, FLAGS.chunk_length, dtype, FLAGS.repeats,
                                                     bandwidth, flops, FLAGS.max_length, dump_hlo, attention_impl=impl,
                                                     quant=quant_spec if quant == "int4" else None, sparse=sparse,
                                                     tensor_parallel=n, spmd=spmd,
                                                     profile_collectives=FLAGS.profile_collectives, kv_cache=kv,
                                                     all_reduce=FLAGS.tp_all_reduce)
                            dump_hlo = None
        result["rows"] = [dict(dataclasses.asdict(r), pct_roofline=r.pct_roofline) for r in rows]
        tables.append(markdown(rows, bandwidth, flops, device, result.get("peer"), result.get("torch_peer"),
                               copy_source, matmul_source))
    text = "\n\n".join(tables)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if FLAGS.markdown_out:
        with open(FLAGS.markdown_out, "w") as f:
            f.write(text + "\n")
    if FLAGS.plot:
        plot(result, FLAGS.plot)
    print(text)


def torch_rooflines(torch_peer: dict | None) -> dict:
    """PyTorch's copy bandwidth and bf16 matmul FLOP/s (``copy_bandwidth_Bps``, ``matmul_flops``): the torch
    peer's, or measured by ``benchmarks.torch_peer --rooflines_only`` in a subprocess; empty without a
    CUDA-enabled torch (the rooflines are then XLA's)."""
    if torch_peer is not None:
        return torch_peer
    if importlib.util.find_spec("torch") is None:
        return {}
    try:
        return run_peer("benchmarks.torch_peer", ["--rooflines_only", "--device", "cuda"])
    except MiniCPMError as e:
        print(f"  no PyTorch rooflines ({e}); they are XLA's", file=sys.stderr)
        return {}


if __name__ == "__main__":
    app.run(main)
