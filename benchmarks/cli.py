"""`python -m build_tools bench` / `python -m benchmarks`: the fused kernel vs MLX's own path vs floors."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import click

from .cases import CASES, DTYPES, SHAPES, TOKENS, VARIANTS

QUICK = dict(shapes=["llama-8b", "phi-4-mini-partial"], tokens=[1, 32, 512], dtypes=["bfloat16"],
             variants=list(VARIANTS))


def _csv(choices, convert=str):
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            raise click.BadParameter(f"empty list; choose from {', '.join(map(str, choices))}")
        allowed = {str(c) for c in choices}
        for v in items:
            if v not in allowed:
                raise click.BadParameter(f"{v!r} is not one of {', '.join(map(str, choices))}")
        return list(dict.fromkeys(convert(v) for v in items))
    return parse


def _command() -> str:
    args = sys.argv[1:]
    prog = "python -m build_tools" if args[:1] == ["bench"] else "python -m benchmarks"
    return " ".join([prog, *(shlex.quote(a) for a in args)])


def _merge(paths):
    """Cells, info and command of one or more --json files of the same backend; a cell measured twice
    is an error (the merged file must say which run each number comes from)."""
    from . import report

    cells, seen, docs = [], {}, []
    for path in paths:
        file_cells, doc = report.load_json(path)
        for c in file_cells:
            key = (c.shape, c.tokens, c.dtype, c.variant)
            if key in seen:
                raise click.UsageError(f"{path}: cell {' '.join(map(str, key))} is also in {seen[key]}")
            seen[key] = path
        cells += file_cells
        docs.append((path, doc))
    backends = {doc["info"].get("backend") for _, doc in docs}
    if len(backends) > 1:
        raise click.UsageError(f"--from-json files come from different backends ({', '.join(map(str, backends))})")
    if len(docs) == 1:
        return cells, docs[0][1]["info"], docs[0][1].get("command", "?")
    info = dict(docs[0][1]["info"])
    info["merged_from"] = [dict(file=Path(p).name, command=d.get("command"), commit=d["info"].get("commit"),
                                date=d["info"].get("date"), cells=len(d["cells"])) for p, d in docs]
    layers = {(d["info"].get("matrix") or {}).get("layers") for _, d in docs}
    if len(layers) > 1:
        raise click.UsageError(f"--from-json files time different step sizes (layers {sorted(map(str, layers))})")
    info["matrix"] = {"layers": layers.pop()}
    return cells, info, " ; ".join(d.get("command", "?") for _, d in docs)


def _micro(kernel, quick, shapes, tokens, dtypes, layers, steps, warmup, json_path, commit, no_check, other) -> None:
    import json

    from . import micro, runner

    unused = [f"--{k.replace('_', '-')}" for k, v in other.items() if v]
    if unused:
        raise click.UsageError(f"--kernel {kernel}: {', '.join(unused)} apply to rope_pool_fused only")
    if quick:
        shapes, tokens, dtypes = shapes or QUICK["shapes"], tokens or QUICK["tokens"], dtypes or QUICK["dtypes"]
    shapes, tokens, dtypes = shapes or list(SHAPES), tokens or list(TOKENS), dtypes or list(DTYPES)
    info, command = runner.host_info(commit), _command()
    click.echo(f"# {info['device']} ({info.get('gpu') or info.get('cpu') or info['platform']}), mlx {info['mlx']}, "
               f"commit {info['commit']}; {kernel} vs MLX's ops, {layers} layers/step, median of >= {steps} steps; "
               f"us per layer (whole step)", err=True)
    click.echo(micro.HEADER)
    cells = micro.run(kernel, shapes, tokens, dtypes, layers=layers, steps=steps, warmup=warmup,
                      progress=lambda i, n, c: click.echo(micro.row(c)), check=not no_check)
    info["matrix"] = dict(kernel=kernel, shapes=shapes, tokens=tokens, dtypes=dtypes, layers=layers, steps=steps,
                          warmup=warmup)
    if json_path:
        json_path.write_text(json.dumps({"info": info, "command": command, "cells": [c.to_json() for c in cells]},
                                        indent=1) + "\n")
        click.echo(f"wrote {json_path}", err=True)


@click.command("bench")
@click.option("--quick", is_flag=True,
              help="A small matrix: llama-8b and phi-4-mini-partial, T in 1/32/512, bf16, all variants "
                   "(filters given with it win).")
@click.option("--shapes", callback=_csv(SHAPES), help=f"Comma list of {', '.join(SHAPES)}.")
@click.option("--tokens", callback=_csv(TOKENS, int), help=f"Comma list of T in {', '.join(map(str, TOKENS))}.")
@click.option("--dtypes", callback=_csv(DTYPES), help="Comma list of bfloat16, float16, float32.")
@click.option("--variants", callback=_csv(VARIANTS), help=f"Comma list of {', '.join(VARIANTS)}.")
@click.option("--cases", callback=_csv(CASES), help=f"Comma list of {', '.join(CASES)} (default: all).")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True,
              help="Layers chained into one step evaluated once.")
@click.option("--steps", type=click.IntRange(min=20), default=20, show_default=True, help="Timed steps (median).")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True, help="Untimed steps per case.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the key results (table per T, targets) as markdown here.")
@click.option("--from-json", "from_json", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Measure nothing: report (table, targets, --plot, --markdown, --json) from earlier --json "
                   "files (repeat to merge runs of one host), restricted to the filters given.")
@click.option("--commit", help="Commit to record when the tree has no .git (e.g. a copy on a benchmark host).")
@click.option("--no-check", is_flag=True, help="Skip checking that fused agrees with MLX's path before timing.")
@click.option("--kernel", type=click.Choice(["rope_pool_fused", "qk_norm_rope_pool_fused", "kv_pool_store"]),
              default="rope_pool_fused", show_default=True,
              help="Which kernel; the last two are micro benchmarks against the MLX ops they replace "
                   "(benchmarks/micro.py: --shapes, --tokens, --dtypes, --layers, --steps, --warmup, --json apply).")
def bench(quick, shapes, tokens, dtypes, variants, cases, layers, steps, warmup, json_path, plot_path, md_path,
          from_json, commit, no_check, kernel) -> None:
    """Per-layer time of RoPE + KV-pool store inside a multi-layer step, on the default device:
    the registry's fused kernel, MLX's own path, the seed's per-request loop, a trivial op, a copy."""
    from . import report, runner

    if kernel != "rope_pool_fused":
        _micro(kernel, quick, shapes, tokens, dtypes, layers, steps, warmup, json_path, commit, no_check,
               other=dict(variants=variants, cases=cases, plot=plot_path, markdown=md_path, from_json=from_json))
        return

    if from_json:
        if quick:
            raise click.UsageError("--from-json reports existing files: --quick does not apply")
        cells, info, command = _merge(from_json)
        keep = lambda c: ((not shapes or c.shape in shapes) and (not tokens or c.tokens in tokens)
                          and (not dtypes or c.dtype in dtypes) and (not variants or c.variant in variants))
        cells = [c for c in cells if keep(c)]
        if not cells:
            raise click.UsageError(f"no cell of {', '.join(map(str, from_json))} matches the filters given")
        click.echo(report.HEADER)
        for c in cells:
            click.echo(report.row(c))
    else:
        if quick:
            shapes, tokens = shapes or QUICK["shapes"], tokens or QUICK["tokens"]
            dtypes, variants = dtypes or QUICK["dtypes"], variants or QUICK["variants"]
        shapes, tokens = shapes or list(SHAPES), tokens or list(TOKENS)
        dtypes, variants, cases = dtypes or list(DTYPES), variants or list(VARIANTS), cases or list(CASES)
        info, command = runner.host_info(commit), _command()
        n = len(shapes) * len(tokens) * len(dtypes) * len(variants)
        click.echo(f"# {info['device']} ({info.get('gpu') or info.get('cpu') or info['platform']}), mlx {info['mlx']}, "
                   f"commit {info['commit']}; {n} cells, {layers} layers/step, median of >= {steps} steps; "
                   f"us per layer (whole step: graph building + evaluation)", err=True)
        click.echo(report.HEADER)
        start = time.monotonic()

        def progress(i, total, cell):
            elapsed = time.monotonic() - start
            eta = elapsed / i * (total - i)
            click.echo(f"{report.row(cell)}   [{i}/{total} {elapsed:.0f}s, ~{eta:.0f}s left]")
            sys.stdout.flush()

        cells = runner.run(shapes, tokens, dtypes, variants, cases, layers=layers, steps=steps, warmup=warmup,
                           progress=progress, check=not no_check)
        info["seconds"] = round(time.monotonic() - start, 1)
        if hasattr(os, "getloadavg"):  # a busy host shows here: its numbers deserve less trust
            info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        info["matrix"] = dict(shapes=shapes, tokens=tokens, dtypes=dtypes, variants=variants, cases=cases,
                              layers=layers, steps=steps, warmup=warmup)
    click.echo("")
    for name, met, evidence in report.targets(cells, info["backend"]):
        click.echo(f"{'MET    ' if met else 'NOT MET'} {name}: {evidence}")
    if json_path:
        report.write_json(json_path, cells, info, command)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        report.plot(plot_path, cells, f"rope_pool_fused per layer in a {info.get('matrix', {}).get('layers', '?')}-layer "
                                      f"step on {info.get('gpu') or info['device']}, mlx {info['mlx']}, commit "
                                      f"{info.get('commit')}, {info.get('date', '')[:10]}", info["backend"])
        click.echo(f"wrote {plot_path}", err=True)
    if md_path:
        report.write_markdown(md_path, cells, info, command)
        click.echo(f"wrote {md_path}", err=True)
