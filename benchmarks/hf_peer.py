"""The HF transformers peer for ``python -m benchmarks --peer hf`` (PyTorch on the same GPU).

Runs in its own process, before JAX takes the GPU: ``python -m benchmarks.hf_peer --shape minicpm4-8b
--contexts 1024,8192 --decode_steps 32 --attn eager,sdpa`` prints one JSON object on its last line.

The model is transformers' ``LlamaForCausalLM`` with the named shape and random bf16 weights: MiniCPM4
is the Llama architecture plus scalar multipliers (embedding, residual and logit scales), which cost
nothing measurable, and transformers has no built-in MiniCPM4 class (the hub code is ``trust_remote_code``).

Rows: prefill tok/s = prompt tokens / time of one forward over the prompt that fills the cache (logits of
the last position only, as ``generate`` does); decode ms/token = time of N greedy one-token forwards with
that cache (HF's default ``DynamicCache``) / N — a bare loop, the best case for HF (``generate`` adds its
own per-token overhead on top). One warm-up run, then ``repeats`` timed runs per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def hf_llama_config(shape: dict):
    """transformers ``LlamaConfig`` with the dimensions of one of ``benchmarks.shapes.SHAPES``."""
    from transformers import LlamaConfig

    from minicpm_jax.config import ModelConfig

    c = ModelConfig.from_dict(shape)
    return LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=max(c.max_position_embeddings, 262144),
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope.theta, tie_word_embeddings=c.tied_head,
    )


def _prefill_then_decode(model, ids, steps: int) -> tuple[float, float]:
    """(seconds to prefill ``ids``, seconds for ``steps`` greedy decode forwards after it)."""
    import torch

    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    sync()
    t1 = time.perf_counter()
    past = out.past_key_values
    for _ in range(steps):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    sync()
    return t1 - t0, time.perf_counter() - t1


def bench_hf(shape: dict, contexts: list[int], decode_steps: int, attn: str, repeats: int,
             device: str = "cuda") -> list[dict]:
    """Prefill and decode rows of HF transformers with ``attn_implementation=attn``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = hf_llama_config(shape)
    config._attn_implementation = attn
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    rows = []
    for ctx in contexts:
        ids = torch.randint(0, config.vocab_size, (1, ctx), device=device)
        row = {"attn": attn, "context": ctx, "prefill_tok_s": [], "decode_ms_per_token": [], "error": None}
        try:
            with torch.inference_mode():
                for rep in range(repeats + 1):  # the first run warms up
                    pre, dec = _prefill_then_decode(model, ids, decode_steps)
                    if rep:
                        row["prefill_tok_s"].append(ctx / pre)
                        row["decode_ms_per_token"].append(1e3 * dec / decode_steps)
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"out of GPU memory ({str(e).splitlines()[0][:120]})"
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"  hf {attn} ctx={ctx}: {row}", file=sys.stderr, flush=True)
        rows.append(row)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(description="HF transformers peer rows for python -m benchmarks")
    p.add_argument("--shape", choices=sorted(SHAPES), default="minicpm4-8b")
    p.add_argument("--contexts", default="1024")
    p.add_argument("--decode_steps", type=int, default=32)
    p.add_argument("--attn", default="eager,sdpa")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: smoke tests only")
    a = p.parse_args()
    import torch
    import transformers

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the HF peer needs a CUDA GPU (torch sees none)")
    rows = []
    for attn in a.attn.split(","):
        rows += bench_hf(SHAPES[a.shape], [int(c) for c in a.contexts.split(",")], a.decode_steps, attn, a.repeats,
                         a.device)
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
