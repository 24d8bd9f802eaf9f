"""The PyTorch peer for ``python -m benchmarks --peer torch``: the strongest PyTorch decode recipe that runs
on the device, written the way gpt-fast writes it (a small Llama decoder, a static KV cache,
``torch.compile(mode="reduce-overhead")`` CUDA graphs for the one-token step, tinygemm int4 g128 through
``torch.ops.aten._weight_int4pack_mm``).

Runs in its own process, before JAX takes the GPU: ``python -m benchmarks.torch_peer --shape minicpm4-8b
--contexts 1024 --quants none,int4`` prints one JSON object on its last line (without a GPU it runs on the
CPU, uncompiled: smoke tests only). ``--linears_ms 1,16`` times tinygemm on each decoder linear instead
(:func:`bench_linears`, the ``int4`` scenario's peer).

The decoder is the Llama architecture of the named shape with random weights (MiniCPM4's scalar
multipliers cost nothing measurable, as for the HF peer), in Hugging Face's weight layout and RoPE
convention, so ``load_hf_state`` takes a ``LlamaForCausalLM`` state dict (the test compares the logits).
Rows: prefill tok/s = prompt tokens / one eager forward over the prompt; decode ms/token = N greedy
one-token steps of the compiled step / N. One warm-up run (it compiles), then ``repeats`` timed runs.
int4: each decoder linear quantized round-to-nearest per group of ``group_size`` input columns, the
asymmetric mid-point form tinygemm takes (``w ≈ (q - 8) · scale + zero``, q in 0..15).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

INNER_K_TILES = 8  # tinygemm's packing: K must be a multiple of 16 × this


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of ``weight [N, K]`` per group of ``group_size`` columns: codes ``int32 [N, K]``
    in 0..15, scales and zeros ``[N, K / group_size]`` (float32) with ``w ≈ (q - 8) · scale + zero``."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = (hi - lo).clamp(min=1e-6) / 15
    zeros = lo + 8 * scales
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, zeros


class Int4Linear(nn.Module):
    """``y = x · dequant(W)ᵀ`` through tinygemm (``_weight_int4pack_mm``; on a CPU its ``_for_cpu`` twin)."""

    def __init__(self, weight: torch.Tensor, group_size: int):
        super().__init__()
        n, k = weight.shape
        if k % group_size or k % (16 * INNER_K_TILES) or n % 8:
            raise ValueError(f"int4 needs K a multiple of {group_size} and {16 * INNER_K_TILES}, N of 8; got {n}x{k}")
        q, scales, zeros = quantize_int4(weight, group_size)
        self.out_features, self.group_size = n, group_size
        self.cpu = weight.device.type == "cpu"
        if self.cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
        else:  # two codes a byte, even columns in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                INNER_K_TILES)
        self.register_buffer("packed", packed)
        # [K / group, N, 2]: (scale, zero) per group and output column
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu if self.cpu else torch.ops.aten._weight_int4pack_mm
        y = mm(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, self.scales_and_zeros)
        return y.reshape(*x.shape[:-1], self.out_features)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Block(nn.Module):
    """Pre-norm attention (fused q/k/v, GQA, static K/V buffers ``[B, kv_heads, L, head_dim]``) + SwiGLU MLP
    (fused gate/up)."""

    def __init__(self, c, batch: int, max_length: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        h = c.hidden_size
        self.attn_norm, self.mlp_norm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.wqkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.w13 = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.w2 = nn.Linear(c.intermediate_size, h, bias=False)
        shape = (batch, self.kv_heads, max_length, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, cos, sin, pos, mask):
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Decoder(nn.Module):
    """The decoder of ``config`` (a :class:`~minicpm_jax.config.ModelConfig`) for ``batch`` rows of up to
    ``max_length`` tokens. ``forward(tokens int64[B, T], pos int64[T])`` → logits ``[B, T, V]``."""

    def __init__(self, config, batch: int, max_length: int):
        super().__init__()
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, batch, max_length) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv = 1.0 / c.rope.theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        angles = torch.outer(torch.arange(max_length, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("slots", torch.arange(max_length), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        mask = (self.slots[None, :] <= pos[:, None])[None, None]  # [1, 1, T, L]: causal over the cache slots
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.head(self.norm(x))

    def load_hf_state(self, state: dict) -> None:
        """Copies a ``LlamaForCausalLM`` state dict in (q/k/v and gate/up concatenated)."""
        with torch.no_grad():
            self.embed.weight.copy_(state["model.embed_tokens.weight"])
            self.norm.weight.copy_(state["model.norm.weight"])
            self.head.weight.copy_(state.get("lm_head.weight", state["model.embed_tokens.weight"]))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.wqkv.weight.copy_(torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
                layer.wo.weight.copy_(state[p + "self_attn.o_proj.weight"])
                layer.w13.weight.copy_(torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
                layer.w2.weight.copy_(state[p + "mlp.down_proj.weight"])
                layer.attn_norm.weight.copy_(state[p + "input_layernorm.weight"])
                layer.mlp_norm.weight.copy_(state[p + "post_attention_layernorm.weight"])

    def quantize(self, group_size: int) -> None:
        """Replaces every decoder linear by its :class:`Int4Linear` (the embedding and head stay dense)."""
        for layer in self.layers:
            for name in ("wqkv", "wo", "w13", "w2"):
                setattr(layer, name, Int4Linear(getattr(layer, name).weight.data, group_size))


def decode_one(model: Decoder, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One greedy step: the next token ``int64[B, 1]`` after ``token`` at position ``pos int64[1]``."""
    return model(token, pos)[:, -1:].argmax(-1)


def bench_torch(shape: dict, contexts: list[int], decode_steps: int, quants: list[str], repeats: int,
                device: str = "cuda", compile_mode: str = "reduce-overhead", group_size: int = 128) -> list[dict]:
    """Prefill and decode rows per (weights, context), batch 1, bf16 activations."""
    from minicpm_jax.config import ModelConfig

    config = ModelConfig.from_dict(shape)
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for quant in quants:
        with torch.device(device):
            model = Decoder(config, 1, max(contexts) + decode_steps + 1).to(torch.bfloat16).eval()
        if quant == "int4":
            model.quantize(group_size)
        step = decode_one if compile_mode == "none" else torch.compile(decode_one, mode=compile_mode, fullgraph=True)
        for ctx in contexts:
            row = {"attn": "torch", "quant": quant, "context": ctx, "prefill_tok_s": [], "decode_ms_per_token": [],
                   "error": None}
            ids = torch.randint(0, config.vocab_size, (1, ctx), device=device)
            try:
                with torch.inference_mode():
                    for rep in range(repeats + 1):  # the first run warms up (and compiles)
                        sync()
                        t0 = time.perf_counter()
                        tok = model(ids, torch.arange(ctx, device=device))[:, -1:].argmax(-1)
                        sync()
                        t1 = time.perf_counter()
                        for i in range(decode_steps):
                            tok = step(model, tok.clone(), torch.tensor([ctx + i], device=device))
                        sync()
                        if rep:
                            row["prefill_tok_s"].append(ctx / (t1 - t0))
                            row["decode_ms_per_token"].append(1e3 * (time.perf_counter() - t1) / decode_steps)
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"out of GPU memory ({str(e).splitlines()[0][:120]})"
            print(f"  torch {quant} ctx={ctx}: {row}", file=sys.stderr, flush=True)
            rows.append(row)
        del model, step
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


L2_BYTES = 50 * 1024**2  # as benchmarks.int4: every timed pass reads more weight bytes than the L2 holds
ITER_BYTES = 2e10  # int4 weight bytes per timed run


def bench_linears(shape: dict, ms: list[int], group_size: int, repeats: int, device: str = "cuda") -> list[dict]:
    """Seconds per call of tinygemm (:class:`Int4Linear`, bf16 activations) on each decoder linear of ``shape``
    (``benchmarks.shapes.linear_shapes``: qkv, o, gate_up, down) at each row count in ``ms``, timed the way
    ``benchmarks.int4`` times ours: a pass over several distinct weights (more bytes than the L2), repeated;
    on a GPU the pass is one CUDA graph (gpt-fast's step runs in graphs too), replayed. One warm-up run, then
    ``repeats`` timed runs. On a CPU (the ``_for_cpu`` twin, a plain loop): smoke values only. A shape
    tinygemm cannot take gets its error as ``seconds``."""
    from benchmarks.shapes import linear_shapes
    from minicpm_jax.config import ModelConfig

    gpu = device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in linear_shapes(ModelConfig.from_dict(shape)).items():
        int4_bytes = k * n // 2 + (k // group_size) * n * 2
        copies = max(4, min(32, -(-2 * L2_BYTES // int4_bytes))) if gpu else 2
        try:
            with torch.device(device):
                linears = [Int4Linear((torch.randn(n, k) * 0.02).to(torch.bfloat16), group_size)
                           for _ in range(copies)]
        except ValueError as e:  # a shape tinygemm cannot pack (K not a multiple of 128): a row that says so
            rows += [{"name": name, "k": k, "n": n, "m": m, "group_size": group_size, "seconds": f"ValueError: {e}"}
                     for m in ms]
            continue
        iters = max(10, min(400, int(ITER_BYTES // (int4_bytes * copies)))) if gpu else 2
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            with torch.inference_mode():
                run = lambda: [lin(x) for lin in linears]  # noqa: E731
                if gpu:  # captured after a warm-up on a side stream, as torch.cuda.graphs requires
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        run()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    run = graph.replay
                times = []
                for rep in range(repeats + 1):
                    sync()
                    t = time.perf_counter()
                    for _ in range(iters):
                        run()
                    sync()
                    if rep:
                        times.append((time.perf_counter() - t) / (iters * copies))
            row = {"name": name, "k": k, "n": n, "m": m, "group_size": group_size, "copies": copies, "seconds": times}
            print(f"  tinygemm {name} m={m}: {row}", file=sys.stderr, flush=True)
            rows.append(row)
        linears = []  # this shape's weights freed before the next shape's
        if gpu:
            torch.cuda.empty_cache()
    return rows


def copy_bandwidth(device: str = "cuda", nbytes: int = 2 * 1024**3, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted): the median of ``repeats`` timed
    ``dst.copy_(src)`` of ``nbytes`` bf16 (PyTorch's vectorised copy kernel, which on an H100 streams
    faster than XLA's copy; the e2e roofline takes the faster of the two)."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]


def matmul_flops(device: str = "cuda", n: int = 8192, repeats: int = 10) -> float:
    """bf16 matmul throughput (FLOP/s) of an ``n``×``n``×``n`` ``torch.mm`` (cuBLAS), median of ``repeats``."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * n**3 / sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(description="gpt-fast-style PyTorch peer rows for python -m benchmarks")
    p.add_argument("--shape", choices=sorted(SHAPES), default="minicpm4-8b")
    p.add_argument("--contexts", default="1024")
    p.add_argument("--decode_steps", type=int, default=32)
    p.add_argument("--quants", default="none,int4", help="none (bf16 weights) and/or int4 (tinygemm g128)")
    p.add_argument("--group_size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when torch sees a GPU (cpu: smoke tests only)")
    p.add_argument("--compile", default="auto",
                   help="torch.compile mode of the decode step, or none (auto: reduce-overhead on cuda, none on cpu)")
    p.add_argument("--rooflines_only", action="store_true",
                   help="only measure the copy bandwidth and the bf16 matmul (no decoder rows)")
    p.add_argument("--linears_ms", default="",
                   help="time tinygemm on each decoder linear at these row counts (e.g. 1,16) instead of the "
                        "decoder rows (the int4 scenario's peer)")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.compile == "auto":
        a.compile = "reduce-overhead" if a.device == "cuda" else "none"
    quants = [q for q in a.quants.split(",") if q]
    if set(quants) - {"none", "int4"}:
        p.error(f"--quants takes none and int4, got {a.quants}")
    try:
        linears_ms = [int(m) for m in a.linears_ms.split(",") if m]
    except ValueError:
        p.error(f"--linears_ms takes row counts like 1,16, got {a.linears_ms}")
    if any(m < 1 for m in linears_ms):
        p.error(f"--linears_ms takes positive row counts, got {a.linears_ms}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the torch peer needs a CUDA GPU (torch sees none)")
    # The ceilings first, while the GPU holds nothing else (a CPU's are smoke values).
    gpu = a.device == "cuda"
    bandwidth = copy_bandwidth(a.device, 2 * 1024**3 if gpu else 64 * 1024**2)
    flops = matmul_flops(a.device, 8192 if gpu else 256)
    decoder = not (a.rooflines_only or linears_ms)
    rows = bench_torch(SHAPES[a.shape], [int(c) for c in a.contexts.split(",")], a.decode_steps, quants, a.repeats,
                       a.device, a.compile, a.group_size) if decoder else []
    out = {"torch": torch.__version__, "device": a.device, "compile": a.compile, "copy_bandwidth_Bps": bandwidth,
           "matmul_flops": flops, "rows": rows}
    if linears_ms and not a.rooflines_only:
        out["linears"] = bench_linears(SHAPES[a.shape], linears_ms, a.group_size, a.repeats, a.device)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
