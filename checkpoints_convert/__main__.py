"""``python -m checkpoints_convert {gguf,hf,gptq,quantize,eagle,frspec,inspect} ...``: offline checkpoint tools.

Every write goes to a temporary directory beside the destination and is renamed into place only when
complete; an existing destination is refused unless ``--overwrite``. Errors print one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from minicpm_jax.errors import MiniCPMError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("gguf", help="GGUF (llama or minicpm architecture) -> Hugging Face style directory")
    g.add_argument("--src", required=True, help="the .gguf file")
    g.add_argument("--dst", required=True, help="output directory")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the dequantized tensors (float32 keeps them exact)")
    g.add_argument("--shard_size_gb", type=float, default=2.0, help="maximum safetensors shard size")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --dst")

    h = sub.add_parser("hf", help="Hugging Face safetensors directory -> native (Orbax) directory")
    h.add_argument("--src", required=True, help="HF model directory (config.json + *.safetensors)")
    h.add_argument("--dst", required=True, help="output directory")
    h.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of the stored parameters (auto: that of the source tensors)")
    h.add_argument("--overwrite", action="store_true", help="replace an existing --dst")

    q = sub.add_parser("gptq", help="GPTQ / marlin-cpmcu int4 checkpoint -> native int4, or -> marlin-cpmcu")
    q.add_argument("--src", required=True, help="GPTQ checkpoint directory (config.json + *.safetensors)")
    q.add_argument("--dst", required=True, help="output directory")
    q.add_argument("--layout", default="native", choices=["native", "marlin"],
                   help="native: Orbax checkpoint in the engine's int4 layout; marlin: CPM.cu's marlin-cpmcu "
                        "directory (model_gptq.safetensors; symmetric, no act-order)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --dst")

    z = sub.add_parser("quantize", help="dense HF checkpoint -> int4 GPTQ checkpoint (RTN or GPTQ, in JAX)")
    z.add_argument("--src", required=True, help="dense HF model directory")
    z.add_argument("--dst", required=True, help="output directory (a standard GPTQ checkpoint)")
    z.add_argument("--method", default="gptq", choices=["rtn", "gptq"], help="round-to-nearest or GPTQ")
    z.add_argument("--group_size", type=int, default=None,
                   help="input rows per scale group; -1 = per-channel (default: 128, or the largest multiple of 16 "
                        "below it that divides every linear's input width)")
    z.add_argument("--asym", action="store_true", help="asymmetric codes with zero points (default symmetric)")
    z.add_argument("--desc_act", action="store_true", help="GPTQ act-order (rows by decreasing Hessian diagonal)")
    z.add_argument("--calibration_file", help="UTF-8 text for GPTQ's Hessians (required for --method gptq)")
    z.add_argument("--num_samples", type=int, default=128, help="calibration sequences at most")
    z.add_argument("--seq_length", type=int, default=512, help="tokens per calibration sequence")
    z.add_argument("--damp_percent", type=float, default=0.01, help="Hessian damping, fraction of mean(diag H)")
    z.add_argument("--no_asym_calibration", dest="asym_calibration", action="store_false",
                   help="classic GPTQ: fit each linear to the partly quantized model's own outputs, all linears "
                        "of a layer on the original layer's inputs (default: GPTAQ's asymmetric calibration, "
                        "fitting the full-precision model's outputs, linears in order; slower, better)")
    z.add_argument("--checkpoint_format", default="auto", choices=["auto", "gptq", "gptq_v2"],
                   help="zero-point convention of the output: gptq = v1 (stored minus one, so a zero point of 0 "
                        "cannot be stored: symmetric codes only), gptq_v2 (as is); auto = gptq for symmetric "
                        "codes, gptq_v2 with --asym")
    z.add_argument("--overwrite", action="store_true", help="replace an existing --dst")

    e = sub.add_parser("eagle", help="EAGLE draft -> another tensor layout (CPM.cu/SafeAILab names or vLLM's)")
    e.add_argument("--src", required=True, help="draft directory (any supported layout)")
    e.add_argument("--dst", required=True, help="output directory")
    e.add_argument("--layout", default="cpmcu", choices=["cpmcu", "vllm"],
                   help="cpmcu: fc / input_norm1/2 / layers.0 (EAGLE-3: midlayer); vllm: model.fc / model.eagle_layers.0")
    e.add_argument("--target", help="target model directory (its embedding and lm_head, for --layout vllm)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --dst")

    f = sub.add_parser("frspec", help="FR-Spec index files (most frequent token ids) from a text corpus")
    f.add_argument("--tokenizer", required=True, help="model directory with the tokenizer")
    f.add_argument("--corpus", required=True, help="UTF-8 text, one document per line")
    f.add_argument("--vocab_sizes", default="8192,16384,32768", help="comma-separated subset sizes")
    f.add_argument("--max_lines", type=int, default=1_000_000, help="lines of the corpus to count")
    f.add_argument("--dst", required=True, help="output directory (freq_<V>.npy files)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing --dst")

    i = sub.add_parser("inspect", help="print what a checkpoint holds")
    i.add_argument("path", help="HF directory, native directory or .gguf file")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--no_tensors", action="store_true", help="omit the tensor list")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        t0 = time.perf_counter()
        if args.command == "gguf":
            from checkpoints_convert.gguf import convert_gguf

            if args.shard_size_gb <= 0:
                raise MiniCPMError("--shard_size_gb must be positive")
            convert_gguf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite,
                         shard_bytes=int(args.shard_size_gb * 1024**3))
            print(f"wrote {args.dst} in {time.perf_counter() - t0:.1f} s")
        elif args.command == "hf":
            from checkpoints_convert.hf import convert_hf

            convert_hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
            print(f"wrote {args.dst} in {time.perf_counter() - t0:.1f} s")
        elif args.command == "gptq":
            from checkpoints_convert.gptq import convert_gptq

            convert_gptq(args.src, args.dst, layout=args.layout, overwrite=args.overwrite)
            print(f"wrote {args.dst} in {time.perf_counter() - t0:.1f} s")
        elif args.command == "quantize":
            from checkpoints_convert.quantize import GPTQSettings, quantize_checkpoint

            for name in ("num_samples", "seq_length"):
                if getattr(args, name) < 1:
                    raise MiniCPMError(f"--{name} must be >= 1")
            if not 0 <= args.damp_percent < 1:
                raise MiniCPMError("--damp_percent must be in [0, 1)")
            settings = GPTQSettings(damp_percent=args.damp_percent, seq_length=args.seq_length,
                                    num_samples=args.num_samples, asym_calibration=args.asym_calibration)
            spec = quantize_checkpoint(args.src, args.dst, method=args.method, group_size=args.group_size,
                                       sym=not args.asym, desc_act=args.desc_act,
                                       calibration_file=args.calibration_file, settings=settings,
                                       checkpoint_format=args.checkpoint_format, overwrite=args.overwrite)
            print(f"wrote {args.dst} ({args.method}, {spec}) in {time.perf_counter() - t0:.1f} s")
        elif args.command == "eagle":
            from checkpoints_convert.eagle import convert_eagle

            kind = convert_eagle(args.src, args.dst, layout=args.layout, target=args.target, overwrite=args.overwrite)
            print(f"wrote {args.dst} ({kind} draft, {args.layout} layout) in {time.perf_counter() - t0:.1f} s")
        elif args.command == "frspec":
            from checkpoints_convert.eagle import make_frspec

            try:
                sizes = [int(x) for x in args.vocab_sizes.split(",") if x.strip()]
            except ValueError:
                raise MiniCPMError(f"--vocab_sizes must be comma-separated integers, got {args.vocab_sizes!r}") from None
            if args.max_lines < 1:
                raise MiniCPMError("--max_lines must be >= 1")
            make_frspec(args.tokenizer, args.corpus, sizes, args.dst, max_lines=args.max_lines, overwrite=args.overwrite)
            print(f"wrote {args.dst} (freq_<V>.npy for V = {', '.join(map(str, sizes))}) in "
                  f"{time.perf_counter() - t0:.1f} s")
        else:
            from checkpoints_convert.inspect_checkpoint import format_summary, inspect

            info = inspect(args.path)
            if args.no_tensors:
                info.pop("tensors")
            print(json.dumps(info, indent=2) if args.json else format_summary(info, not args.no_tensors))
    except MiniCPMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
