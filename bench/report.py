"""Printing and plotting what `reprise bench` measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tables(results: dict[str, Any]) -> str:
    """A readable table per scenario that ran."""
    lines: list[str] = []
    if "repeat" in results:
        r = results["repeat"]
        lines += [
            f"repeat: one {r['prompt_tokens']}-token prompt",
            f"  time to first token: first {_ms(r['ttft_first_s'])}, repeats {_ms(r['ttft_repeat_s'])}"
            f" ({r['cached_tokens_repeat']} tokens cached), reuse off {_ms(r['ttft_reuse_off_s'])}",
            f"  repeat / first {r['repeat_over_first']:.3f}, repeat / reuse off "
            f"{r['repeat_over_reuse_off']:.3f}",
            "",
        ]
    if "prefix" in results:
        lines += [
            f"prefix: TTFT vs cached prefix length (+{results['prefix']['suffix_tokens']} new tokens)"
        ]
        lines += [f"  {'prefix':>8}{'cached':>8}{'on':>11}{'off':>11}{'on/off':>8}"]
        for p in results["prefix"]["points"]:
            lines.append(
                f"  {p['prefix_tokens']:8}{p['cached_tokens']:8}{_ms(p['ttft_on_s']):>11}"
                f"{_ms(p['ttft_off_s']):>11}{p['on_over_off']:8.3f}"
            )
        lines.append("")
    for name, title in (
        ("shared", "shared system prompt"),
        ("hosttier", "working set over the device pool"),
    ):
        if name in results:
            r = results[name]
            lines += [f"{name}: {title}", f"  {'':26}{'on':>12}{'off':>12}{'on/off':>8}"]
            for key, value in r["on"].items():
                ratio = r["on_over_off"].get(key)
                lines.append(
                    f"  {key:26}{_fmt(key, value):>12}{_fmt(key, r['off'][key]):>12}"
                    f"{'' if ratio is None else f'{ratio:8.3f}'}"
                )
            lines.append("")
    if "chat" in results:
        r = results["chat"]
        lines += [f"chat: {r['turns']} turns", f"  {'turn':>4}{'prompt':>8}{'computed on':>13}{'off':>7}"
                  f"{'TTFT on':>11}{'off':>11}"]  # fmt: skip
        for idx, (on, off) in enumerate(zip(r["on"]["turns"], r["off"]["turns"], strict=True)):
            lines.append(
                f"  {idx + 1:4}{on['prompt_tokens']:8}{on['prefill_tokens_computed']:13}"
                f"{off['prefill_tokens_computed']:7}{_ms(on['ttft_s']):>11}{_ms(off['ttft_s']):>11}"
            )
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in r["on_over_off"].items() if v is not None)
        lines += [f"  on / off: {ratios}", ""]
    if "sweep" in results:
        lines += [
            "sweep: throughput vs concurrent requests",
            f"  {'batch':>6}{'tok/s':>10}{'decode tok/s':>14}",
        ]
        for p in results["sweep"]["points"]:
            decode = p["decode_tokens_per_s"]
            lines.append(
                f"  {p['batch_size']:6}{p['tokens_per_s']:10.1f}{'' if decode is None else f'{decode:14.1f}'}"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> bool:
    """TTFT vs prefix length (reuse on vs off) and throughput vs batch size, as a PNG.
    Returns False when matplotlib is not installed (pip install 'reprise[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [name for name in ("prefix", "sweep") if name in results]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        points = results[name]["points"]
        if name == "prefix":
            x = [p["prefix_tokens"] for p in points]
            ax.plot(x, [1e3 * p["ttft_on_s"] for p in points], "o-", label="reuse on")
            ax.plot(x, [1e3 * p["ttft_off_s"] for p in points], "s--", label="reuse off")
            ax.set(xlabel="cached prefix (tokens)", ylabel="time to first token (ms)")
            ax.set_title("Time to first token vs cached prefix")
            ax.legend()
        else:
            x = [p["batch_size"] for p in points]
            ax.plot(x, [p["tokens_per_s"] for p in points], "o-")
            ax.set(xlabel="concurrent requests", ylabel="generated tokens / s")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.set_title("Throughput vs batch size")
        ax.grid(alpha=0.3)
    meta = results.get("meta", {})
    fig.suptitle(
        f"reprise bench: {meta.get('model', '')} on {meta.get('backend', '')}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"


def _fmt(key: str, value: Any) -> str:
    return _ms(value) if key.endswith("_s") else f"{value}"
