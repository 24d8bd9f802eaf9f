"""A real EAGLE draft on real prompts: ``python -m benchmarks.draft --draft_path DIR``.

Each prompt (the held-out chat prompts shipped beside the self-distillation set by default) is answered
greedily at batch 1 by the plain engine and by the speculative engine with the draft, for each
``--spec_num_iters`` at ``--tree_size``: mean accept length (tokens per round, the bonus token included,
over all rounds of all prompts), decode tokens/s of both (decode tokens over decode seconds, compilation
excluded; the first prompt is a warm-up and not counted), their ratio, and how many answers are identical
(greedy speculative output equals plain greedy output up to the kernels' rounding: verify reads a tree,
decode one token). The target is the demo model unless ``--target`` names another.

    python -m benchmarks.draft --draft_path demo --prompts 16 --num_generate 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _engines(model, draft, num_iters, tree_size, frspec):
    from minicpm_jax.engine.engine import Engine
    from minicpm_jax.engine.speculative.engine import SpeculativeEngine
    from minicpm_jax.engine.speculative.rounds import SpecConfig

    yield "plain", None, Engine(model, batch_size=1, chunk_length=256, decode_block=16)
    for n in num_iters:
        spec = SpecConfig(num_iter=n, topk_per_iter=10, tree_size=tree_size).check()
        yield f"eagle num_iter={n}", n, SpeculativeEngine(model, draft, spec=spec, frspec_ids=frspec, batch_size=1,
                                                          chunk_length=256, decode_block=max(1, 16 // n))


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minicpm_jax.cli.demo import DEMO_DRAFT_DIR, resolve_model_path
    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.io.frspec import read_frspec
    from minicpm_jax.model.loading import load_draft, load_model
    from minicpm_jax.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
    from minicpm_jax.train.distill import PACKAGED_PROMPTS, read_prompts

    path = resolve_model_path(args.target, progress=False)
    dtype = jnp.dtype(args.dtype) if args.dtype != "auto" else (
        jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    model = load_model(path, dtype=dtype, max_length=args.max_length)
    tok = load_tokenizer(path)
    prompts_file = args.prompts_file or os.path.join(PACKAGED_PROMPTS, "heldout_prompts.txt")
    prompts = [encode_prompt(tok, p) for p in read_prompts(prompts_file)][: args.prompts + 1]
    stops = stop_token_ids(model.config, tok, path)
    draft_path = DEMO_DRAFT_DIR if args.draft_path == "demo" else args.draft_path
    draft = load_draft(draft_path, model.config, max_length=model.max_length,
                       attention_impl=model.attention_impl, dtype=model.dtype)
    frspec = None if args.frspec_path is None else read_frspec(args.frspec_path, model.config.vocab_size,
                                                                args.frspec_vocab_size)
    rows, answers = [], {}
    for name, n, engine in _engines(model, draft, args.spec_num_iters, args.tree_size, frspec):
        counts = None
        dec_tokens, dec_s, outs = 0, 0.0, []
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            res, stats = engine.generate([ids], sampling=SamplingParams(), max_new_tokens=args.num_generate,
                                         stop_token_ids=stops)
            outs.append(res[0].token_ids)
            if i == 0:  # warm-up: compiles every shape the others use
                continue
            dec_tokens += stats.decode_tokens
            dec_s += stats.decode_time
            if stats.spec_accepted is not None:
                c = np.asarray(stats.spec_accepted, np.int64)
                counts = c if counts is None else np.pad(counts, (0, max(0, len(c) - len(counts)))) + np.pad(
                    c, (0, max(0, len(counts) - len(c))))
        answers[name] = outs[1:]
        row = {"engine": name, "num_iter": n, "tree_size": args.tree_size if n else None, "prompts": len(outs) - 1,
               "decode_tokens": dec_tokens, "decode_s": dec_s,
               "decode_tokens_per_s": dec_tokens / dec_s if dec_s else 0.0, "wall_s": time.perf_counter() - t0}
        if counts is not None:
            rounds = int(counts.sum())
            row["rounds"] = rounds
            row["mean_accept_length"] = float((counts * np.arange(len(counts))).sum() / max(rounds, 1))
            row["identical_answers"] = sum(a == b for a, b in zip(outs[1:], answers["plain"]))
            row["speedup_vs_plain"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "dtype": jnp.dtype(dtype).name, "target": path, "draft": args.draft_path,
            "num_generate": args.num_generate, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"{result['device']} ({result['backend']}, jax {result['jax']}, {result['dtype']}), greedy, batch 1, "
             f"{result['rows'][0]['prompts']} held-out prompts, up to {result['num_generate']} tokens each",
             "", "| engine | mean accept length | decode tok/s | vs plain | identical answers |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = f"{r['mean_accept_length']:.2f}" if "mean_accept_length" in r else "—"
        ratio = f"{r['speedup_vs_plain']:.2f}×" if "speedup_vs_plain" in r else "—"
        same = f"{r['identical_answers']}/{r['prompts']}" if "identical_answers" in r else "—"
        lines.append(f"| {r['engine']} | {acc} | {r['decode_tokens_per_s']:.1f} | {ratio} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft_path", required=True, help="the draft directory; demo = the demo model's")
    p.add_argument("--target", default=None, help="target model (default: the demo model)")
    p.add_argument("--frspec_path", default=None)
    p.add_argument("--frspec_vocab_size", type=int, default=32768)
    p.add_argument("--prompts_file", default=None, help="prompts, one per line (default: the shipped held-out set)")
    p.add_argument("--prompts", type=int, default=64, help="how many prompts (after one warm-up)")
    p.add_argument("--num_generate", type=int, default=256)
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--spec_num_iters", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 4])
    p.add_argument("--tree_size", type=int, default=12)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="weights and activations (auto: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--json_out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
