"""`python -m build_tools bench` / `python -m benchmarks`: the fused kernel vs MLX's own path vs floors."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click

from . import e2e as e2e_bench
from .cases import CASES, DTYPES, MAX_LAYERS, SHAPES, TOKENS, VARIANTS, memory_budget

ATTENTION_KERNELS = ("decode_attention", "decode_attention_quantized")   # benchmarks/attention.py
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


def _ints(flag: str):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            items = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected a comma list of positive integers") from None
        if not items or min(items) < 1:
            raise click.BadParameter(f"{value!r}: expected a comma list of positive integers")
        return list(dict.fromkeys(items))
    return parse


def _kv_bits(ctx, param, value):
    """--kv-bits: a comma list of none, 8, 4 -> [None, 8, 4]."""
    if value is None:
        return None
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in ("none", "8", "4")]
    if not items or bad:
        raise click.BadParameter(f"{value!r}: expected a comma list of none, 8, 4 (the float cache, mlx-lm's 8-bit "
                                 f"and 4-bit quantized caches)")
    return list(dict.fromkeys(None if v == "none" else int(v) for v in items))


def _output(ctx, param, value: Path | None) -> Path | None:
    """An output file the run will be able to write, checked before anything is measured: its
    directory is made (as the write would make it) and a file is created and removed there."""
    if value is None:
        return None
    if not value.name:                       # "" (Path("") is "."; "." and "/" click refuses as directories)
        raise click.BadParameter("an empty path; expected a file path")
    try:
        nearest = value.parent
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        if not nearest.is_dir():
            raise click.BadParameter(f"{value}: {nearest} is not a directory")
        value.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{value.name}.", suffix=".probe", dir=value.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise click.BadParameter(f"{value}: cannot write there ({e.strerror or e})") from None
    return value


def _plot_output(ctx, param, value: Path | None) -> Path | None:
    """--plot: matplotlib must import before anything is measured (a run takes minutes, and its
    other outputs are written only at the end), then the file as _output checks it."""
    if value is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise click.BadParameter(f"writing a plot needs matplotlib, which does not import here ({e}): "
                                     f"pip install -e '.[bench]'") from None
    return _output(ctx, param, value)


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
        try:
            file_cells, doc = report.load_json(path)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
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

    from . import micro, report, runner

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
        doc = {"info": info, "command": command, "cells": [c.to_json() for c in cells]}
        report.atomic_write(json_path, lambda fh: fh.write((json.dumps(doc, indent=1) + "\n").encode()))
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
@click.option("--layers", type=click.IntRange(min=1, max=MAX_LAYERS), default=32, show_default=True,
              help="Layers chained into one step evaluated once.")
@click.option("--steps", type=click.IntRange(min=20), default=20, show_default=True, help="Timed steps (median).")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True, help="Untimed steps per case.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=_output, help="Write results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), callback=_plot_output,
              help="Write a PNG here (needs matplotlib: the `bench` extra).")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, path_type=Path), callback=_output,
              help="Write the key results (table per T, targets) as markdown here.")
@click.option("--from-json", "from_json", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Measure nothing: report (table, targets, --plot, --markdown, --json) from earlier --json "
                   "files (repeat to merge runs of one host), restricted to the filters given.")
@click.option("--commit", help="Commit to record when the tree has no .git (e.g. a copy on a benchmark host).")
@click.option("--no-check", is_flag=True, help="Skip checking that fused agrees with MLX's path before timing.")
@click.option("--e2e", is_flag=True,
              help="End-to-end greedy decode of real-size mlx-lm models (random weights): mlx-lm's own loop vs "
                   "the slot engine's modes. Takes the --e2e options below, --dtypes (default bf16,f16; CPU bf16) and the output options.")
@click.option("--sizes", callback=_csv(e2e_bench.SIZES),
              help=f"--e2e: comma list of {', '.join(e2e_bench.SIZES)} (default: {', '.join(e2e_bench.GPU_SIZES)} on a GPU, "
                   f"{', '.join(e2e_bench.CPU_SIZES)} on the CPU).")
@click.option("--batches", callback=_ints("--batches"), help="--e2e: comma list of batch sizes (default 1,8,32; CPU 1,8).")
@click.option("--prompts", callback=_ints("--prompts"),
              help="--e2e: comma list of prompt lengths (default 128,2048; CPU 32,128).")
@click.option("--decode-tokens", type=click.IntRange(min=2),
              help="--e2e: tokens generated per request (default 64; CPU 32).")
@click.option("--modes", callback=_csv(e2e_bench.MODES), help=f"--e2e: comma list of {', '.join(e2e_bench.MODES)} (default: all).")
@click.option("--rounds", type=click.IntRange(min=1), help="--e2e: interleaved timed rounds, median kept (default 3).")
@click.option("--pool-size", type=click.IntRange(min=1),
              help="--e2e: slot-engine KV slots per layer (default: batch x (prompt + decode tokens - 1)).")
@click.option("--prefill-step-size", type=click.IntRange(min=1),
              help="--e2e: mlx-lm's prefill chunk (its generate_step's and BatchGenerator's prefill_step_size; default "
                   "mlx-lm's 2048). Long batched prompts may need less: stock's masked attention holds a chunk's "
                   "scores for every key.")
@click.option("--kv-bits", "kv_bits", callback=_kv_bits,
              help="--e2e: comma list of the caches to run mlx-lm's modes on: none (the float cache), 8, 4 (mlx-lm's "
                   "quantized cache: stock through generate_step(kv_bits=...), the drop-in through make_prompt_cache("
                   "kv_bits=...)); default none. With 8 or 4 the default --modes is mlx_lm,mlx_lm_fused_cache (the "
                   "slot engine has float pools only).")
@click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
              help="--e2e: the quantized caches' group size (features per scale and bias).")
@click.option("--smoke", is_flag=True,
              help="--e2e: a seconds-long run (tiny-llama, batch 1 and 2, prompt 16, 4 tokens, 1 round; "
                   "filters given with it win).")
@click.option("--kernel", type=click.Choice(["rope_pool_fused", "qk_norm_rope_pool_fused", "kv_pool_store",
                                            *ATTENTION_KERNELS]),
              default="rope_pool_fused", show_default=True,
              help="Which kernel; qk_norm_rope_pool_fused and kv_pool_store are micro benchmarks against the MLX "
                   "ops they replace (benchmarks/micro.py: --shapes, --tokens, --dtypes, --layers, --steps, --warmup, "
                   "--json apply); decode_attention against MLX's masked and unmasked attention and the K/V read "
                   "floor, decode_attention_quantized at 8 and 4 bits against decode_attention and against "
                   "mx.dequantize + MLX's masked attention, each against its format's floor (benchmarks/attention.py: "
                   "--dtypes, --layers, --steps, --json, --txt, --commit apply, and for the quantized one "
                   "--kv-group-size).")
@click.option("--txt", "txt_path", type=click.Path(dir_okay=False, path_type=Path), callback=_output,
              help="--kernel decode_attention[_quantized]: also write the text table (it is printed either way).")
def bench(quick, shapes, tokens, dtypes, variants, cases, layers, steps, warmup, json_path, plot_path, md_path,
          from_json, commit, no_check, e2e, sizes, batches, prompts, decode_tokens, modes, rounds, pool_size,
          prefill_step_size, kv_bits, kv_group_size, smoke, kernel, txt_path) -> None:
    """Per-layer time of RoPE + KV-pool store inside a multi-layer step, on the default device:
    the registry's fused kernel, MLX's own path, the seed's per-request loop, a trivial op, a copy.
    With --e2e: end-to-end decode tokens/s of real-size models (docs/benchmarks/README.md)."""
    from .cases import BenchmarkError

    try:
        _bench(**click.get_current_context().params)
    except BenchmarkError as err:            # an agreement check that fails, an output that cannot be written
        raise click.ClickException(str(err)) from None


def _bench(quick, shapes, tokens, dtypes, variants, cases, layers, steps, warmup, json_path, plot_path, md_path,
           from_json, commit, no_check, e2e, sizes, batches, prompts, decode_tokens, modes, rounds, pool_size,
           prefill_step_size, kv_bits, kv_group_size, smoke, kernel, txt_path) -> None:
    from . import report, runner

    ctx = click.get_current_context()
    given = lambda name: ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT
    micro_only = ("quick", "shapes", "tokens", "variants", "cases", "layers", "steps", "warmup")
    e2e_only = ("sizes", "batches", "prompts", "decode_tokens", "modes", "rounds", "pool_size", "prefill_step_size",
                "kv_bits", "kv_group_size", "smoke")
    flag = lambda name: "--" + name.replace("_", "-")
    if e2e:
        bad = [flag(n) for n in micro_only + ("kernel", "txt_path") if given(n)]
        if bad:
            raise click.UsageError(f"{', '.join(bad)}: not options of --e2e (they configure the per-layer benchmark)")
        return _e2e(dtypes, sizes, batches, prompts, decode_tokens, modes, rounds, pool_size, prefill_step_size, smoke,
                    json_path, plot_path, md_path, commit, no_check, from_json, kv_bits=kv_bits,
                    kv_group_size=int(kv_group_size))
    quantized = kernel == "decode_attention_quantized"
    bad = [flag(n) for n in e2e_only if given(n) and not (quantized and n == "kv_group_size")]
    if bad:
        raise click.UsageError(f"{', '.join(bad)}: only with --e2e" + (
            " (and --kv-group-size with --kernel decode_attention_quantized)" if "--kv-group-size" in bad else ""))
    if kernel in ATTENTION_KERNELS:
        from . import attention

        unused = [f for n, f in (("quick", "--quick"), ("shapes", "--shapes"), ("tokens", "--tokens"),
                                 ("variants", "--variants"), ("cases", "--cases"), ("plot_path", "--plot"),
                                 ("md_path", "--markdown"), ("from_json", "--from-json"), ("no_check", "--no-check"),
                                 ("warmup", "--warmup")) if given(n)]
        if unused or (dtypes and len(dtypes) > 1):
            raise click.UsageError(f"--kernel {kernel} takes --dtypes (one), --layers, --steps, --json, --txt, "
                                   + ("--kv-group-size, " if quantized else "")
                                   + f"--commit; not {', '.join(unused) or '--dtypes with several'}")
        argv = [f"--dtype={dtypes[0]}" if dtypes else "--dtype=bfloat16", f"--layers={layers}", f"--steps={steps}"]
        argv += ["--quantized", f"--group-size={kv_group_size}"] if quantized else []
        argv += [f"--json={json_path}"] if json_path else []
        argv += [f"--txt={txt_path}"] if txt_path else []
        argv += [f"--commit={commit}"] if commit else []
        attention.main(argv)
        return
    if txt_path:
        raise click.UsageError(f"--txt: only with --kernel {' or '.join(ATTENTION_KERNELS)}")
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


def _e2e_merge(paths):
    """Cells, skipped, info and command of one or more `bench --e2e --json` files (of one backend); a cell
    measured twice is an error."""
    from . import report

    cells, skipped, seen, docs = [], [], {}, []
    for path in paths:
        try:
            file_cells, doc = report.load_e2e_json(path)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
        for c in file_cells:
            key = (c.size, c.dtype, c.batch, c.prompt, c.mode) + (() if c.kv_bits is None else (f"{c.kv_bits}-bit",))
            if key in seen:
                raise click.UsageError(f"{path}: cell {' '.join(map(str, key))} is also in {seen[key]}")
            seen[key] = path
        cells += file_cells
        skipped += doc.get("skipped", [])
        docs.append((path, doc))
    if len({d["info"].get("backend") for _, d in docs}) > 1:
        raise click.UsageError("--from-json files come from different backends")
    info = dict(docs[0][1]["info"])
    if len(docs) > 1:
        info["merged_from"] = [dict(file=Path(p).name, command=d.get("command"), commit=d["info"].get("commit"),
                                    date=d["info"].get("date"), cells=len(d["cells"])) for p, d in docs]
        info["checks"] = [c for _, d in docs for c in d["info"].get("checks", [])]
        info["sizes"] = {k: v for _, d in docs for k, v in d["info"].get("sizes", {}).items()}
    return cells, skipped, info, " ; ".join(d.get("command", "?") for _, d in docs)


def _e2e_report(cells, skipped, info, command, json_path, plot_path, md_path) -> None:
    from . import report

    click.echo(report.e2e_table(cells))
    for (mode, bits, why), n in Counter((s["mode"], s.get("kv_bits"), s["reason"]) for s in skipped).items():
        click.echo(f"skipped {mode}{'' if bits is None else f' {bits}-bit'} in {n} cell{'s' if n > 1 else ''}: {why}")
    click.echo("")
    for name, met, evidence in report.e2e_targets(cells, info["backend"]):
        click.echo(f"{'MET    ' if met else 'NOT MET'} {name}: {evidence}")
    summary = report.dropin_summary(cells)
    if summary:
        click.echo("\nThe drop-in cache over stock mlx-lm, decode tokens/s (stock → drop-in), as markdown "
                   "(README.md's table):\n" + summary)
    if json_path:
        report.write_e2e_json(json_path, cells, skipped, info, command)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        report.e2e_plot(plot_path, cells, f"greedy decode tokens/s on {info.get('gpu') or info['device']}, "
                                          f"mlx {info['mlx']}, commit {info.get('commit')}, {info.get('date', '')[:10]}")
        click.echo(f"wrote {plot_path}", err=True)
    if md_path:
        report.write_e2e_markdown(md_path, cells, skipped, info, command)
        click.echo(f"wrote {md_path}", err=True)


def _e2e(dtypes, sizes, batches, prompts, decode_tokens, modes, rounds, pool_size, prefill_step_size, smoke, json_path,
         plot_path, md_path, commit, no_check, from_json=(), kv_bits=None, kv_group_size=e2e_bench.KV_GROUP_SIZE
         ) -> None:
    from . import report, runner

    if from_json:
        ctx = click.get_current_context()
        bad = [f"--{n.replace('_', '-')}" for n in ("sizes", "batches", "prompts", "decode_tokens", "modes", "rounds",
                                                     "pool_size", "prefill_step_size", "smoke", "dtypes", "commit",
                                                     "no_check", "kv_bits", "kv_group_size")
               if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT]
        if bad:
            raise click.UsageError(f"--from-json reports existing files: {', '.join(bad)} do not apply")
        return _e2e_report(*_e2e_merge(from_json), json_path, plot_path, md_path)
    info = runner.host_info(commit)
    on_cpu = info["backend"] == "cpu"
    if smoke:
        sizes, batches, prompts = sizes or ["tiny-llama"], batches or [1, 2], prompts or [16]
        decode_tokens, rounds, dtypes = decode_tokens or 4, rounds or 1, dtypes or ["bfloat16"]
    E = e2e_bench
    if on_cpu:
        sizes, dtypes, batches = sizes or list(E.CPU_SIZES), dtypes or list(E.CPU_DTYPES), batches or list(E.CPU_BATCHES)
        prompts, decode_tokens = prompts or list(E.CPU_PROMPTS), decode_tokens or E.CPU_DECODE_TOKENS
    sizes, dtypes, batches = sizes or list(E.GPU_SIZES), dtypes or ["bfloat16", "float16"], batches or list(E.BATCHES)
    prompts, decode_tokens = prompts or list(E.PROMPTS), decode_tokens or E.DECODE_TOKENS
    kv_bits = kv_bits or [None]
    quantized = [b for b in kv_bits if b is not None]
    if quantized and modes:
        engine = [m for m in modes if m in E.ENGINE_MODES]
        if engine:   # SlotEngine keeps float pools (registry/integrations/slot_engine.py): no quantized form
            raise click.BadParameter(f"--kv-bits {','.join(map(str, quantized))}: the slot engine's modes "
                                     f"({', '.join(engine)}) have float pools only, no quantized cache; leave them out "
                                     f"of --modes (mlx_lm, mlx_lm_fused_cache run quantized)", param_hint="--kv-bits")
    rounds, modes = rounds or E.ROUNDS, modes or list(E.QUANT_MODES if quantized else E.MODES)
    need = e2e_bench.pool_needed(max(batches), max(prompts), decode_tokens)
    if pool_size is not None and need > pool_size:
        raise click.BadParameter(f"{pool_size} slots cannot hold batch {max(batches)} x (prompt {max(prompts)} + "
                                 f"{decode_tokens} decode tokens - 1) = {need}: raise --pool-size or lower "
                                 f"--batches/--prompts", param_hint="--pool-size")
    slots, budget = pool_size or need, memory_budget()
    for s in sizes:                          # the engine's K and V pools alone, in the widest dtype
        c = e2e_bench.SIZES[s].config
        kv = 2 * slots * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * \
            max(4 if d == "float32" else 2 for d in dtypes)
        if kv > budget:
            raise click.BadParameter(f"{s}: {slots} KV slots need {kv / 2**30:.1f} GiB of pools; at most half of "
                                     f"this machine's memory ({budget / 2**30:.1f} GiB): lower --batches/--prompts/"
                                     f"--decode-tokens (or --pool-size)", param_hint="--batches/--prompts/"
                                                                                   "--decode-tokens/--pool-size")
    if any(m in ("mlx_lm", "mlx_lm_fused_cache") for m in modes):   # BatchGenerator's cells need a whole-batch step
        lag = max((E.batch_lag(E.prompt_lengths(b, p), prefill_step_size) for b in batches if b > 1 for p in prompts),
                  default=0)
        if decode_tokens < lag + 2:
            raise click.BadParameter(f"{decode_tokens}: mlx-lm's BatchGenerator decodes the shorter prompts (3/4 of the "
                                     f"length) {lag} steps before the longest's first token and so finishes them "
                                     f"first; decode is timed where every request decodes, so ask for at least "
                                     f"{lag + 2} tokens (or a larger --prefill-step-size)", param_hint="--decode-tokens")
    if on_cpu:
        big = [s for s in sizes if not e2e_bench.SIZES[s].cpu]
        if big:
            click.echo(f"# warning: {', '.join(big)} are GPU sizes; on the CPU a cell takes minutes", err=True)
    n = len(sizes) * len(dtypes) * len(batches) * len(prompts)
    click.echo(f"# {info['device']} ({info.get('gpu') or info.get('cpu') or info['platform']}), mlx {info['mlx']}, "
               f"commit {info['commit']}; {n} cells x {len(modes)} modes x {len(kv_bits)} caches "
               f"({', '.join('float' if b is None else f'{b}-bit' for b in kv_bits)}), {decode_tokens} decode tokens, median of "
               f"{rounds} interleaved rounds; decode tokens/s (whole batch)", err=True)
    start = time.monotonic()
    log = lambda line: click.echo(line, err=True)
    said: set = set()

    def progress(i, total, cells, skipped):
        elapsed = time.monotonic() - start
        for c in cells:
            log(report.e2e_progress_row(c))
        for (m, bits), why in skipped.items():
            if (m, bits, why) not in said:        # once per reason
                said.add((m, bits, why))
                log(f"  skipped {m}{'' if bits is None else f' {bits}-bit'}: {why}")
        log(f"  [{i}/{total} {elapsed:.0f}s, ~{elapsed / i * (total - i):.0f}s left]")

    cells, skipped, checks = E.run(sizes, dtypes, batches, prompts, decode_tokens, modes, rounds, pool_size,
                                     check=not no_check, progress=progress, log=log,
                                     prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size)
    info["seconds"] = round(time.monotonic() - start, 1)
    if hasattr(os, "getloadavg"):
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    info["matrix"] = dict(sizes=sizes, dtypes=dtypes, batches=batches, prompts=prompts, decode_tokens=decode_tokens,
                          modes=modes, rounds=rounds, pool_size=pool_size, prefill_step_size=prefill_step_size,
                          kv_bits=kv_bits, kv_group_size=kv_group_size if quantized else None)
    info["sizes"] = {s: e2e_bench.SIZES[s].note for s in sizes}
    info["checks"] = checks if not no_check else ["skipped (--no-check)"]
    _e2e_report(cells, skipped, info, _command(), json_path, plot_path, md_path)
