"""Flags shared by ``minicpm_jax.run``, ``.server`` and ``.perplexity`` (the "model", "speculative" and
"system" groups), the loader and engine factory that read them, and the one-line descriptions of what was
loaded."""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.attention import ATTENTION_CHOICES
from pallas_kernels import backend

FLAGS = flags.FLAGS
_M, _S, _SP, _PA = "model", "system", "speculative", "parallel"

flags.DEFINE_string("model_path", None, "HF model directory or native (converted) directory; omitted: the "
                    "SmolLM2 demo model.", module_name=_M)
flags.DEFINE_enum("dtype", "auto", ["auto", "bfloat16", "float16", "float32"],
                  "Weight/activation dtype; auto = bfloat16 on GPU, float32 on CPU.", module_name=_M)
flags.DEFINE_enum("attention_impl", "auto", list(ATTENTION_CHOICES),
                  "Kernel backend of every op (attention, KV writes, the int4 matmul, InfLLM-v2): pallas = the Pallas "
                  "kernels (attention reads only the valid cache), xla = the plain-jnp references; auto = pallas on "
                  "GPU, xla on CPU.", module_name=_M)
flags.DEFINE_enum("quant", "auto", ["auto", "none", "int4"],
                  "Decoder-linear weights: auto = as the checkpoint stores them (GPTQ / marlin-cpmcu / native int4 "
                  "stay int4), none = dequantize an int4 checkpoint, int4 = round-to-nearest W4A16 of a dense "
                  "checkpoint at load time. Embeddings, norms and lm_head always stay in --dtype.", module_name=_M)
flags.DEFINE_integer("quant_group_size", 128, "Scale group size (input rows) for --quant int4 on a dense checkpoint; "
                     "-1 = per-channel.", module_name=_M)
flags.DEFINE_enum("sparse", "auto", ["auto", "on", "off"],
                  "InfLLM-v2 sparse attention: auto = as the checkpoint's sparse_config says, on = that or MiniCPM4's "
                  "defaults (block 64, topk 64, window 2048, dense_len 8192), off = dense attention.", module_name=_M)
flags.DEFINE_integer("sparse_topk", None, "Sparse: top-k blocks per query besides the local window (sparse_config "
                     "topk).", module_name=_M)
flags.DEFINE_integer("sparse_window", None, "Sparse: local window in tokens, always attended (sparse_config "
                     "window_size).", module_name=_M)
flags.DEFINE_integer("dense_len", None, "Sparse: sequences shorter than this attend densely (sparse_config "
                     "dense_len); 0 or -1 = always sparse (MiniCPM's dense_len -1, CPM.cu's --sparse-switch 0).",
                     module_name=_M)
flags.DEFINE_boolean("minicpm4_yarn", False, "Replace the rope factors by MiniCPM4's LongRoPE list validated to 128K "
                     "tokens (CPM.cu's --minicpm4-yarn; head_dim 128 models).", module_name=_M)
flags.DEFINE_string("max_length", "auto", "Static KV-cache length per sequence (prompt plus generated tokens), or "
                    "auto: on a GPU the largest that fits --memory_limit (at most the model's context), on a CPU "
                    "2048.", module_name=_M)
flags.DEFINE_float("memory_limit", 0.9, "Fraction of the accelerator's memory the engine may take (weights, cache, "
                   "workspace); sets XLA_PYTHON_CLIENT_MEM_FRACTION unless that is set.", module_name=_M)
flags.DEFINE_integer("chunk_length", 512, "Prefill chunk length (one compiled shape).", module_name=_M)
flags.DEFINE_integer("decode_block", 16, "Decode steps per host round trip (streaming granularity).", module_name=_M)

flags.DEFINE_string("draft_path", None, "EAGLE draft directory (CPM.cu MiniCPM4 EAGLE, SafeAILab EAGLE-1/2 or -3, "
                    "vLLM): decode with speculative trees; 'demo' = the draft shipped for the demo model. Omitted: "
                    "plain decoding.", module_name=_SP)
flags.DEFINE_integer("spec_num_iter", 2, "Draft steps per round = deepest tree level (up to num_iter + 1 tokens per "
                     "round).", module_name=_SP)
flags.DEFINE_integer("spec_topk_per_iter", 10, "Children per expanded draft node and frontier width.", module_name=_SP)
flags.DEFINE_integer("spec_tree_size", 12, "Tree nodes verified per round, root included (<= 64).", module_name=_SP)
flags.DEFINE_integer("spec_window_size", 1024, "Committed tokens the draft attends to during rounds (0 = all).",
                     module_name=_SP)
flags.DEFINE_string("frspec_path", None, "FR-Spec index: CPM.cu freq_<V>.pt, a .npy or a text file of token ids, or "
                    "a directory holding freq_<--frspec_vocab_size>.pt.", module_name=_SP)
flags.DEFINE_integer("frspec_vocab_size", 32768, "FR-Spec: keep this many most frequent ids (and pick the file in a "
                     "directory).", module_name=_SP)


flags.DEFINE_integer("tensor_parallel", 1, "Split the model over this many devices (tensor parallelism over JAX SPMD: "
                     "attention heads, MLP channels and vocabulary; the KV cache with its heads). 1 = one device.",
                     module_name=_PA)
flags.DEFINE_enum("tp_all_reduce", "auto", ["auto", "peer", "xla", "nccl"], "All-reduce of a split model: peer "
                  "(the pallas backend's one-shot kernel through peer memory, inside the step's CUDA graph; needs every "
                  "device on GPUs of this process), xla (XLA's own one-shot kernel), nccl (NCCL through XLA), or auto "
                  "(peer where it can run, else xla; docs/parallel.md).",
                  module_name=_PA)
flags.DEFINE_string("coordinator_address", None, "Several hosts: host:port of process 0, for "
                    "jax.distributed.initialize (default $JAX_COORDINATOR_ADDRESS, or what JAX detects on SLURM / "
                    "Open MPI clusters). Every process runs the same command.", module_name=_PA)
flags.DEFINE_integer("num_processes", None, "Several hosts: how many processes take part (default: detected).",
                     module_name=_PA)
flags.DEFINE_integer("process_id", None, "Several hosts: this process's index, 0 .. num_processes - 1 (default: "
                     "detected).", module_name=_PA)

flags.DEFINE_boolean("compilation_cache", True, "Persistent JAX compilation cache in $MINICPM_JAX_CACHE/jax_cache.",
                     module_name=_S)
flags.DEFINE_boolean("xla_command_buffers", True, "Let XLA record the decode loop (while/conditional bodies "
                     "included) into CUDA graphs (adds --xla_gpu_enable_command_buffer to XLA_FLAGS unless set there).",
                     module_name=_S)


def fail(message: str) -> None:
    """Ends a command-line program with a one-line error (no traceback) and exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def validate_model_flags() -> None:
    """Checks the model flags before anything heavy happens; raises MiniCPMError."""
    max_length_flag()
    if not 0 < FLAGS.memory_limit <= 1:
        raise MiniCPMError(f"--memory_limit must be in (0, 1], got {FLAGS.memory_limit}")
    for name in ("chunk_length", "decode_block", "tensor_parallel"):
        if getattr(FLAGS, name) < 1:
            raise MiniCPMError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.num_processes is not None and FLAGS.num_processes < 1:
        raise MiniCPMError(f"--num_processes must be >= 1, got {FLAGS.num_processes}")
    if FLAGS.process_id is not None and not 0 <= FLAGS.process_id < (FLAGS.num_processes or FLAGS.process_id + 1):
        raise MiniCPMError(f"--process_id must be in 0 .. --num_processes - 1, got {FLAGS.process_id}")
    if FLAGS.draft_path == "demo":
        from minicpm_jax.cli.demo import DEMO_DRAFT_DIR

        if FLAGS.model_path:
            raise MiniCPMError("--draft_path demo is the demo model's draft: omit --model_path to use it")
        FLAGS.draft_path = DEMO_DRAFT_DIR
    if FLAGS.draft_path is not None:
        if not os.path.isdir(FLAGS.draft_path):
            raise MiniCPMError(f"--draft_path {FLAGS.draft_path!r} is not a directory")
        spec_config_from_flags()
    if FLAGS.frspec_path is not None:
        if FLAGS.draft_path is None:
            raise MiniCPMError("--frspec_path needs --draft_path (FR-Spec restricts the draft's vocabulary)")
        if not os.path.exists(FLAGS.frspec_path):
            raise MiniCPMError(f"--frspec_path {FLAGS.frspec_path!r} does not exist")
        if FLAGS.frspec_vocab_size < 1:
            raise MiniCPMError(f"--frspec_vocab_size must be >= 1, got {FLAGS.frspec_vocab_size}")
    for name, field, low in (("sparse_topk", "topk", 1), ("dense_len", "dense_len", -1), ("sparse_window", "window_size", 0)):
        val = getattr(FLAGS, name)
        if val is not None and val < low:
            raise MiniCPMError(f"--{name}: sparse {field} must be >= {low}, got {val}")


def max_length_flag() -> int | None:
    """``--max_length`` as a number, or None for ``auto``; MiniCPMError if it is neither."""
    text = FLAGS.max_length.strip().lower()
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise MiniCPMError(f"--max_length must be a number of tokens or auto, got {FLAGS.max_length!r}") from None
    if value < 2:
        raise MiniCPMError(f"--max_length must be >= 2, got {value}")
    return value


def apply_system_flags() -> None:
    """The system flags: XLA command buffers and the memory fraction (before JAX starts), joining the other
    processes of a multi-host run (``jax.distributed``), the compilation cache."""
    from minicpm_jax.cli.system import (enable_command_buffers, enable_compilation_cache, start_distributed,
                                        use_nccl_all_reduce)

    # JAX preallocates this fraction of a GPU at start; --max_length auto sizes the cache inside it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{FLAGS.memory_limit:.3f}")
    if FLAGS.xla_command_buffers:
        enable_command_buffers()
    if FLAGS.tensor_parallel > 1 and FLAGS.tp_all_reduce == "nccl":
        use_nccl_all_reduce()
    start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if FLAGS.compilation_cache:
        enable_compilation_cache()


def mesh_from_flags():
    """The device mesh ``--tensor_parallel`` asks for (None for one device), with its peer-memory workspace
    for ``--tp_all_reduce peer``; MiniCPMError when there are not that many devices or they cannot share
    memory."""
    from minicpm_jax.model.parallel import make_mesh, set_all_reduce

    if FLAGS.tensor_parallel <= 1:
        return None
    mesh = make_mesh(FLAGS.tensor_parallel)
    if FLAGS.tp_all_reduce == "peer" and FLAGS.attention_impl != backend.AUTO and not backend.reduces_through_peers(
            FLAGS.attention_impl):
        raise MiniCPMError(f"--tp_all_reduce peer is a kernel of the pallas backend; --attention_impl "
                           f"{FLAGS.attention_impl} reduces through XLA")
    note = set_all_reduce(mesh, FLAGS.tp_all_reduce)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return mesh


def weights_description(model) -> str:
    """``"dense"`` or e.g. ``"int4 g128 sym kpacked"`` (JSON output, server banner)."""
    q = model.quant
    if q is None:
        return "dense"
    group = "per-channel" if q.group_size == -1 else f"g{q.group_size}"
    return f"int4 {group} {'sym' if q.sym else 'asym'}{' act-order' if q.act_order else ''} kpacked"


def sparse_description(model) -> str:
    """``"off"`` or e.g. ``"topk 64 + window 2048 (96 blocks of 64) from 8192 tokens"`` (JSON, banner)."""
    s = model.sparse
    if s is None:
        return "off"
    start = "always" if s.always_sparse else f"from {s.dense_len} tokens"
    text = f"topk {s.topk} + window {s.window_size} ({s.num_selected} blocks of {s.block_size}) {start}"
    return text if model.sparse_active else f"{text}, inactive: max_length {model.max_length} < dense_len"


def speculative_description(engine) -> str:
    """``"off"`` or e.g. ``"minicpm EAGLE draft, tree 12 (2 steps x top-10), window 1024, FR-Spec 32768"``."""
    spec = getattr(engine, "spec", None)
    if spec is None:
        return "off"
    ids = engine.frspec_ids
    vocab = ("own vocabulary " + str(engine.draft.spec.draft_vocab) if engine.draft.own_head else
             f"FR-Spec {ids.shape[0]}" if ids is not None else "full vocabulary")
    return (f"{engine.draft.spec.kind} EAGLE draft, tree {spec.tree_size} ({spec.num_iter} steps x top-"
            f"{spec.topk_per_iter}), window {spec.window_size or 'all'}, {vocab}")


def paged_kv_from_flags(kv_cache: str, page_size: int) -> bool:
    """Whether the KV cache is paged: ``paged`` / ``contiguous`` as named; ``auto`` pages it unless the
    model attends sparsely with blocks of another size than ``page_size`` (InfLLM-v2 over pages needs a
    page per block; MiniCPM4's blocks are the default page size, 64)."""
    if kv_cache != "auto":
        return kv_cache == "paged"
    from minicpm_jax.cli.demo import resolve_model_path
    from minicpm_jax.infllm.policy import resolve_sparse
    from minicpm_jax.model.loading import target_config

    config = target_config(resolve_model_path(FLAGS.model_path, progress=False), minicpm4_yarn=FLAGS.minicpm4_yarn)
    sparse = resolve_sparse(config, FLAGS.sparse, **sparse_overrides_from_flags())
    return sparse is None or sparse.block_size == page_size


def cache_length_from_flags(model_path: str, dtype, *, batch_size: int, paged: bool = False) -> int:
    """The KV-cache length ``--max_length`` asks for, checked against the model's positions and memory:
    ``auto`` is the largest that fits ``--memory_limit`` on a GPU (2048 on a CPU), both capped at the
    context the model supports; a number that does not fit is a MiniCPMError naming one that does. A paged
    cache holds no row of its own: its ``max_length`` only bounds one sequence, and ``auto`` on a GPU is the
    model's whole context."""
    import jax

    from minicpm_jax.engine import memory
    from minicpm_jax.infllm.policy import resolve_sparse
    from minicpm_jax.model.loading import check_max_length, target_config, weight_bytes

    config = target_config(model_path, minicpm4_yarn=FLAGS.minicpm4_yarn)
    wanted = max_length_flag()
    if wanted is not None:
        check_max_length(config, wanted)
        if paged:
            return wanted
    elif jax.default_backend() == "cpu":
        return min(memory.CPU_AUTO_LENGTH, config.context_limit)
    elif paged:
        return config.context_limit
    sparse = resolve_sparse(config, FLAGS.sparse, **sparse_overrides_from_flags())
    weights = weight_bytes(model_path, dtype=dtype, quant=FLAGS.quant, group_size=FLAGS.quant_group_size,
                           minicpm4_yarn=FLAGS.minicpm4_yarn, tensor_parallel=FLAGS.tensor_parallel)
    if FLAGS.draft_path is not None:  # one layer, its cache and head: bounded by twice its files
        weights += 2 * sum(os.path.getsize(os.path.join(FLAGS.draft_path, f)) for f in os.listdir(FLAGS.draft_path)
                           if f.endswith((".safetensors", ".bin")))
    sizing = dict(batch_size=batch_size, dtype=dtype, sparse=sparse, weights=weights,
                  budget=memory.device_budget(FLAGS.memory_limit), chunk_length=FLAGS.chunk_length,
                  tensor_parallel=FLAGS.tensor_parallel)
    if wanted is None:
        return memory.auto_max_length(config, **sizing)
    memory.check_fits(config, max_length=wanted, **sizing)
    return wanted


def sparse_overrides_from_flags() -> dict:
    """The InfLLM-v2 field overrides the sparse flags give (None = the checkpoint's)."""
    return dict(topk=FLAGS.sparse_topk, window_size=FLAGS.sparse_window, dense_len=FLAGS.dense_len)


def dtype_from_flags() -> str:
    """``--dtype``, with auto resolved: float32 on a CPU (exact), bfloat16 on an accelerator."""
    import jax

    if FLAGS.dtype != "auto":
        return FLAGS.dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_from_flags(*, progress: bool = True, batch_size: int = 1, paged: bool = False):
    """Loads what the model flags name: returns (model_path, model, tokenizer, load seconds).

    Without --model_path the SmolLM2 demo model is prepared (converted once) and used. batch_size: the
    engine's rows, for sizing the cache (``--max_length auto``); paged: the cache will be a pool of pages
    (``--max_length auto`` is then the model's context on a GPU).
    """
    import jax.numpy as jnp

    from minicpm_jax.cli.demo import resolve_model_path
    from minicpm_jax.model.loading import load_model
    from minicpm_jax.tokenizer import load_tokenizer

    model_path = resolve_model_path(FLAGS.model_path, progress=progress)
    dtype = dtype_from_flags()
    t0 = time.perf_counter()
    mesh = mesh_from_flags()
    max_length = cache_length_from_flags(model_path, jnp.dtype(dtype), batch_size=batch_size, paged=paged)
    model = load_model(model_path, dtype=jnp.dtype(dtype), max_length=max_length,
                       attention_impl=FLAGS.attention_impl, quant=FLAGS.quant, group_size=FLAGS.quant_group_size,
                       sparse=FLAGS.sparse, sparse_overrides=sparse_overrides_from_flags(),
                       minicpm4_yarn=FLAGS.minicpm4_yarn, mesh=mesh)
    tokenizer = load_tokenizer(model_path)
    if backend.interprets(model.attention_impl):
        print(f"warning: --attention_impl {model.attention_impl} without a GPU runs the Pallas kernels in interpret "
              "mode, meant for tests: expect minutes per token (use --attention_impl auto or xla)",
              file=sys.stderr, flush=True)
    return model_path, model, tokenizer, time.perf_counter() - t0


def spec_config_from_flags():
    """The speculative tree settings of the flags (checked)."""
    from minicpm_jax.engine.speculative.rounds import SpecConfig

    return SpecConfig(num_iter=FLAGS.spec_num_iter, topk_per_iter=FLAGS.spec_topk_per_iter,
                      tree_size=FLAGS.spec_tree_size, window_size=FLAGS.spec_window_size).check()


def make_engine(model, *, batch_size: int, scratch_rows: int = 1, paging=None):
    """A plain :class:`~minicpm_jax.engine.engine.Engine`, or a speculative one when ``--draft_path`` is
    given (the draft loaded for ``model``, with the FR-Spec subset of ``--frspec_path``); paging: a
    :class:`~minicpm_jax.engine.paging.Paging` for a paged cache, None for the contiguous one."""
    from minicpm_jax.engine.engine import Engine

    if FLAGS.draft_path is None:
        return Engine(model, batch_size=batch_size, chunk_length=FLAGS.chunk_length, decode_block=FLAGS.decode_block,
                      scratch_rows=scratch_rows, paging=paging)
    from minicpm_jax.engine.speculative.engine import SpeculativeEngine
    from minicpm_jax.io.frspec import read_frspec
    from minicpm_jax.model.loading import load_draft

    draft = load_draft(FLAGS.draft_path, model.config, max_length=model.max_length,
                       attention_impl=model.attention_impl, dtype=model.dtype)
    ids = None
    if FLAGS.frspec_path is not None:
        ids = read_frspec(FLAGS.frspec_path, model.config.vocab_size, FLAGS.frspec_vocab_size)
    # decode_block counts rounds here: keep about the same tokens per host round trip.
    rounds = max(1, FLAGS.decode_block // max(1, FLAGS.spec_num_iter))
    return SpeculativeEngine(model, draft, spec=spec_config_from_flags(), frspec_ids=ids, batch_size=batch_size,
                             chunk_length=FLAGS.chunk_length, decode_block=rounds, scratch_rows=scratch_rows,
                             paging=paging)
