"""`python -m build_tools bench` / `python -m benchmarks`: the fused kernel vs MLX's own path vs floors."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from .cases import CASES, DTYPES, SHAPES, TOKENS, VARIANTS


def _csv(choices):
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [v.strip() for v in value.split(",") if v.strip()]
        for v in items:
            if str(v) not in {str(c) for c in choices}:
                raise click.BadParameter(f"{v!r} is not one of {', '.join(map(str, choices))}")
        return items
    return parse


@click.command("bench")
@click.option("--quick", is_flag=True, help="A small matrix: llama-8b and phi-4-mini, T in 1/32/512, bf16, base.")
@click.option("--shapes", callback=_csv(SHAPES), help=f"Comma list of {', '.join(SHAPES)}.")
@click.option("--tokens", callback=_csv(TOKENS), help="Comma list of T values.")
@click.option("--dtypes", callback=_csv(DTYPES), help="Comma list of bfloat16, float16, float32.")
@click.option("--variants", callback=_csv(VARIANTS), help="Comma list of base, freqs, traditional.")
@click.option("--cases", callback=_csv(CASES), help=f"Comma list of {', '.join(CASES)} (default: all).")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--steps", type=click.IntRange(min=20), default=20, show_default=True, help="Timed steps (median).")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG here.")
def bench(quick, shapes, tokens, dtypes, variants, cases, layers, steps, warmup, json_path, plot_path) -> None:
    """Per-layer time of rope + KV-pool store inside a multi-layer step, on the default device."""
    from . import report, runner

    if quick:
        shapes = shapes or ["llama-8b", "phi-4-mini-partial"]
        tokens = tokens or [1, 32, 512]
        dtypes = dtypes or ["bfloat16"]
        variants = variants or ["base"]
    shapes = shapes or list(SHAPES)
    tokens = [int(t) for t in (tokens or TOKENS)]
    dtypes = dtypes or ["bfloat16", "float16", "float32"]
    variants = variants or list(VARIANTS)
    cases = cases or list(CASES)
    info = runner.host_info()
    click.echo(f"# {info['device']} ({info.get('gpu') or info['platform']}), mlx {info['mlx']}, "
               f"{layers} layers/step, median of {steps} steps; times in us per layer", err=True)
    click.echo(report.HEADER)

    def progress(i, n, cell):
        click.echo(report.row(cell) + f"   [{i}/{n}]")
        sys.stdout.flush()

    cells = runner.run(shapes, tokens, dtypes, variants, cases, layers=layers, steps=steps, warmup=warmup,
                       progress=progress)
    click.echo("")
    for name, met, evidence in report.targets(cells, info["backend"]):
        click.echo(f"{'MET    ' if met else 'NOT MET'} {name}: {evidence}")
    args = sys.argv[1:]
    prog = "python -m build_tools" if args[:1] == ["bench"] else "python -m benchmarks"
    command = " ".join([prog, *(shlex.quote(a) for a in args)])
    if json_path:
        report.write_json(json_path, cells, info, command)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        report.plot(plot_path, cells, f"rope_pool_fused on {info.get('gpu') or info['device']}, mlx {info['mlx']}, "
                                      f"commit {info.get('commit')}")
        click.echo(f"wrote {plot_path}", err=True)
