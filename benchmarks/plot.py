"""``--plot``: decode ms/token against context (the e2e rows by attention path, the HF peer's) and the
decode-kernel µs against context, from a result dict (also a saved ``--json_out``)."""

from __future__ import annotations

import statistics

from minicpm_jax.errors import MiniCPMError


def plot(result: dict, path: str) -> None:
    """decode ms/token vs context (e2e rows by attention path, HF peer rows) and decode-kernel µs vs context."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MiniCPMError("--plot needs matplotlib (pip install matplotlib)") from None
    panels = [k for k in ("rows", "kernels") if result.get(k)]
    if not panels:
        raise MiniCPMError("nothing to plot: the results have no e2e or kernels rows")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "rows":
            series = sorted({(r["attention_impl"], r.get("quant", "none")) for r in result["rows"]})
            for impl, quant in series:
                rows = sorted((r for r in result["rows"] if (r["attention_impl"], r.get("quant", "none")) == (impl, quant)),
                              key=lambda r: r["context"])
                label = impl if quant == "none" else f"{impl}, {quant}"
                ax.plot([r["context"] for r in rows], [statistics.median(r["decode_ms_per_token"]) for r in rows], "o-",
                        label=f"minicpm-jax ({label})")
            for attn in sorted({r["attn"] for r in result.get("peer", {}).get("rows", [])}):
                rows = [r for r in result["peer"]["rows"] if r["attn"] == attn and r["decode_ms_per_token"]]
                ax.plot([r["context"] for r in rows], [statistics.median(r["decode_ms_per_token"]) for r in rows], "s--",
                        label=f"HF transformers ({attn})")
            ax.set_title(f"{result['shape']} decode, batch 1")
            ax.set_ylabel("ms / token")
            ax.set_yscale("log")
        else:
            for impl in ("pallas", "xla", "cudnn"):
                pts = [(r["context"], 1e6 * statistics.median(r["seconds"][impl])) for r in result["kernels"]["decode"]
                       if isinstance(r["seconds"].get(impl), list)]
                if pts:
                    ax.plot(*zip(*pts), "o-", label=impl)
            ax.set_title("decode attention kernel (one layer)")
            ax.set_ylabel("µs / call")
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(result.get("device", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
