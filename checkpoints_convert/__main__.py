"""``python -m checkpoints_convert {gguf,hf,inspect} ...``: offline checkpoint tools.

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

    g = sub.add_parser("gguf", help="GGUF (llama architecture) -> Hugging Face style directory")
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
