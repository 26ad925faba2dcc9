"""Tables, JSON and plots from benchmark cells, and the target checks of docs/benchmarks/."""

from __future__ import annotations

import json
from pathlib import Path

from .runner import Cell

HEADER = (f"{'shape':<20}{'T':>6} {'dtype':<9}{'variant':<12}{'fused':>9}{'mlx':>9}{'seed':>9}{'trivial':>9}"
          f"{'copy':>9}{'speedup':>8}{'x triv':>7}{'GB/s':>7}{'BW %':>6}")


def _f(x, fmt):
    return format(x, fmt) if x is not None else "-"


def row(c: Cell) -> str:
    us = c.us_per_layer
    share = c.bandwidth_share()
    return (f"{c.shape:<20}{c.tokens:>6} {c.dtype:<9}{c.variant:<12}{_f(us.get('fused'), '9.1f')}"
            f"{_f(us.get('mlx'), '9.1f')}{_f(us.get('seed_loop'), '9.1f')}{_f(us.get('trivial'), '9.1f')}"
            f"{_f(us.get('copy'), '9.1f')}{_f(c.speedup_vs_mlx(), '8.2f')}{_f(c.ratio_to_trivial(), '7.2f')}"
            f"{_f(c.bandwidth_gbs(), '7.0f')}{_f(share * 100 if share else None, '6.0f')}")


def targets(cells: list[Cell], backend: str) -> list[tuple[str, bool, str]]:
    """(target, met, evidence) for the native-kernel issue's targets that apply to `backend`."""
    out = []
    fused = [c for c in cells if "fused" in c.us_per_layer and "mlx" in c.us_per_layer]
    if not fused:
        return out
    slower = [c for c in fused if c.speedup_vs_mlx() < 1.0]
    out.append(("never slower than MLX's own path (every cell)", not slower,
                f"{len(fused) - len(slower)}/{len(fused)} cells faster; min speedup "
                f"{min(c.speedup_vs_mlx() for c in fused):.2f}x"
                + (f"; slower: {', '.join(f'{c.shape} T={c.tokens} {c.dtype} {c.variant}' for c in slower[:8])}"
                   if slower else "")))
    if backend in ("cuda", "metal"):
        decode = [c for c in fused if c.tokens <= 512 and c.dtype in ("bfloat16", "float16") and c.ratio_to_trivial()]
        if decode:
            worst = max(decode, key=lambda c: c.ratio_to_trivial())
            out.append(("T <= 512 (bf16/f16) within 1.3x of a trivial op", worst.ratio_to_trivial() <= 1.3,
                        f"worst {worst.ratio_to_trivial():.2f}x ({worst.shape} T={worst.tokens} {worst.dtype} "
                        f"{worst.variant}); median {sorted(c.ratio_to_trivial() for c in decode)[len(decode) // 2]:.2f}x"))
        big = [c for c in fused if c.tokens >= 2048 and c.dtype in ("bfloat16", "float16") and c.bandwidth_share()]
        if big:
            worst = min(big, key=lambda c: c.bandwidth_share())
            out.append(("T >= 2048 (bf16/f16) at >= 60% of copy bandwidth", worst.bandwidth_share() >= 0.6,
                        f"worst {worst.bandwidth_share() * 100:.0f}% ({worst.shape} T={worst.tokens} {worst.dtype} "
                        f"{worst.variant}, {worst.bandwidth_gbs():.0f} GB/s vs copy {worst.bandwidth_gbs('copy'):.0f})"))
    if backend == "cpu":
        small = [c for c in fused if c.tokens <= 32]
        if small:
            worst = min(small, key=lambda c: c.speedup_vs_mlx())
            out.append(("CPU: >= 3x MLX's own path at T <= 32", worst.speedup_vs_mlx() >= 3.0,
                        f"worst {worst.speedup_vs_mlx():.2f}x ({worst.shape} T={worst.tokens} {worst.dtype} {worst.variant})"))
    return out


def write_json(path: Path, cells: list[Cell], info: dict, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"info": info, "command": command, "cells": [c.to_json() for c in cells]}, indent=1))


def load_json(path: Path) -> tuple[list[Cell], dict]:
    data = json.loads(path.read_text())
    cells = [Cell(**{k: c[k] for k in ("shape", "tokens", "dtype", "variant", "implementation", "us_per_layer",
                                        "bytes_per_layer")}) for c in data["cells"]]
    return cells, data


def plot(path: Path, cells: list[Cell], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        if c.variant == "base" and c.dtype in ("bfloat16", "float32"):
            groups.setdefault((c.shape, c.dtype), []).append(c)
    for (shape, dtype), cs in sorted(groups.items()):
        cs = sorted(cs, key=lambda c: c.tokens)
        style = "-" if dtype == "bfloat16" else ":"
        xs = [c.tokens for c in cs]
        axes[0].plot(xs, [c.speedup_vs_mlx() for c in cs], style, marker="o", label=f"{shape} {dtype}")
        shares = [(c.tokens, c.bandwidth_share()) for c in cs if c.bandwidth_share()]
        if shares:
            axes[1].plot(*zip(*shares), style, marker="o", label=f"{shape} {dtype}")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens per step (T)", ylabel="speedup vs MLX's own path (x)",
                title="fused rope+pool vs mx.fast.rope + 2 scatters")
    axes[1].axhline(0.6, color="r", lw=0.8, ls="--", label="60% target")
    axes[1].set(xscale="log", xlabel="tokens per step (T)", ylabel="share of measured copy bandwidth",
                title="achieved bandwidth / copy floor", ylim=(0, 1.2))
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
