"""Tables, JSON, plots and markdown from benchmark cells, and the target checks of docs/benchmarks/."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from .cases import BenchmarkError
from .runner import Cell

# Targets of the native-kernel issue (docs/benchmarks/README.md).
DECODE_MAX_T, DECODE_MAX_RATIO = 512, 1.3      # GPU: fused within 1.3x of a trivial op at T <= 512
PREFILL_MIN_T, PREFILL_MIN_SHARE = 2048, 0.6   # GPU: >= 60% of the copy bandwidth at T >= 2048
CPU_MAX_T, CPU_MIN_SPEEDUP = 32, 3.0           # CPU: >= 3x MLX's own path at T <= 32
HALF = ("bfloat16", "float16")                 # the GPU targets are stated for bf16 and f16

_COLUMNS = (("shape", "<20"), ("T", ">6"), ("dtype", ">9"), ("variant", ">12"), ("fused", ">9"), ("mlx", ">9"),
            ("seed", ">9"), ("trivial", ">9"), ("copy", ">9"), ("speedup", ">8"), ("x triv", ">7"),
            ("GB/s", ">7"), ("BW %", ">6"))
HEADER = "".join(format(name, spec) for name, spec in _COLUMNS)


def _f(x, fmt: str) -> str:
    """`x` formatted, or '-' padded to the same width when there is no value."""
    width = int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit()) or 0)
    return format(x, fmt) if x is not None else "-".rjust(width)


def row(c: Cell) -> str:
    us = c.us_per_layer
    share = c.bandwidth_share()
    return (f"{c.shape:<20}{c.tokens:>6}{c.dtype:>9}{c.variant:>12}{_f(us.get('fused'), '9.1f')}"
            f"{_f(us.get('mlx'), '9.1f')}{_f(us.get('seed_loop'), '9.1f')}{_f(us.get('trivial'), '9.1f')}"
            f"{_f(us.get('copy'), '9.1f')}{_f(c.speedup_vs_mlx(), '8.2f')}{_f(c.ratio_to_trivial(), '7.2f')}"
            f"{_f(c.bandwidth_gbs(), '7.0f')}{_f(share * 100 if share else None, '6.0f')}")


def _name(c: Cell) -> str:
    return f"{c.shape} T={c.tokens} {c.dtype} {c.variant}"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def targets(cells: list[Cell], backend: str) -> list[tuple[str, bool, str]]:
    """(target, met, evidence) for each target of the native-kernel issue that applies to `backend`
    and to the measured cells. Verdicts use whole-step times (what an engine pays); the evidence also
    gives the eval-only figure, which excludes building the graph in Python."""
    out = []
    both = [c for c in cells if c.speedup_vs_mlx() is not None]
    if both:
        slower = [c for c in both if c.speedup_vs_mlx() < 1.0]
        worst = min(both, key=lambda c: c.speedup_vs_mlx())
        out.append(("never slower than MLX's own path (every cell)", not slower,
                    f"{len(both) - len(slower)}/{len(both)} cells faster; min speedup {worst.speedup_vs_mlx():.2f}x "
                    f"({_name(worst)})" + (f"; slower: {', '.join(_name(c) for c in slower[:8])}"
                                           + (f" and {len(slower) - 8} more" if len(slower) > 8 else "")
                                           if slower else "")))
    if backend in ("cuda", "metal"):
        decode = [c for c in cells if c.tokens <= DECODE_MAX_T and c.dtype in HALF and c.ratio_to_trivial()]
        if decode:
            worst = max(decode, key=lambda c: c.ratio_to_trivial())
            over = sum(c.ratio_to_trivial() > DECODE_MAX_RATIO for c in decode)
            evals = [c.ratio_to_trivial("eval") for c in decode if c.ratio_to_trivial("eval")]
            out.append((f"T <= {DECODE_MAX_T} (bf16/f16) within {DECODE_MAX_RATIO}x of a trivial op",
                        over == 0,
                        f"{len(decode) - over}/{len(decode)} cells within; worst {worst.ratio_to_trivial():.2f}x "
                        f"({_name(worst)}); median {_median(c.ratio_to_trivial() for c in decode):.2f}x"
                        + (f"; eval only: median {_median(evals):.2f}x, worst {max(evals):.2f}x" if evals else "")))
        big = [c for c in cells if c.tokens >= PREFILL_MIN_T and c.dtype in HALF and c.bandwidth_share()]
        if big:
            worst = min(big, key=lambda c: c.bandwidth_share())
            under = sum(c.bandwidth_share() < PREFILL_MIN_SHARE for c in big)
            out.append((f"T >= {PREFILL_MIN_T} (bf16/f16) at >= {PREFILL_MIN_SHARE:.0%} of copy bandwidth",
                        under == 0,
                        f"{len(big) - under}/{len(big)} cells at or above; worst {worst.bandwidth_share():.0%} "
                        f"({_name(worst)}, {worst.bandwidth_gbs():.0f} GB/s vs copy {worst.bandwidth_gbs('copy'):.0f}); "
                        f"median {_median(c.bandwidth_share() for c in big):.0%}"))
    if backend == "cpu":
        small = [c for c in both if c.tokens <= CPU_MAX_T]
        if small:
            worst = min(small, key=lambda c: c.speedup_vs_mlx())
            under = sum(c.speedup_vs_mlx() < CPU_MIN_SPEEDUP for c in small)
            out.append((f"CPU: >= {CPU_MIN_SPEEDUP:g}x MLX's own path at T <= {CPU_MAX_T}", under == 0,
                        f"{len(small) - under}/{len(small)} cells at or above; worst {worst.speedup_vs_mlx():.2f}x "
                        f"({_name(worst)}); median {_median(c.speedup_vs_mlx() for c in small):.2f}x"))
    return out


def atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename: readers never see half a
    file. An OSError (a full disk, a directory gone since the CLI checked it) is a BenchmarkError
    naming the file."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise BenchmarkError(f"{path}: cannot write it ({e.strerror or e})") from None
        raise


def write_json(path: Path, cells: list[Cell], info: dict, command: str) -> None:
    doc = {"info": info, "command": command, "cells": [c.to_json() for c in cells]}
    atomic_write(path, lambda fh: fh.write(json.dumps(doc, indent=1).encode()))


_CELL_FIELDS = ("shape", "tokens", "dtype", "variant", "implementation", "us_per_layer", "bytes_per_layer")


def _read_doc(path: Path, made_by: str) -> dict:
    """The document of a --json file, checked to hold 'info' and a 'cells' list."""
    if Path(path).exists() and not Path(path).is_file():   # a FIFO or a device would block the read
        raise ValueError(f"{path}: not a regular file")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable benchmark JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or not isinstance(data.get("info"), dict):
        raise ValueError(f"{path}: expected an object with 'info' and a 'cells' list (from `{made_by}`)")
    return data


_NUMBER = (int, float)


def _check_values(path: Path, i: int, c: dict, kinds: dict) -> None:
    """cells[i] holds each field as the report computes with it (kinds: a type tuple, "times" a dict
    of numbers or nulls, "list" a list of numbers)."""
    for k, kind in kinds.items():
        if k not in c:                      # an optional field (load_e2e_json checked the required ones)
            continue
        v = c[k]
        if kind == "int?":
            ok = v is None or (isinstance(v, int) and not isinstance(v, bool))
        elif kind == "times":
            ok = isinstance(v, dict) and all(x is None or isinstance(x, _NUMBER) for x in v.values())
        elif kind == "list":
            ok = isinstance(v, list) and all(isinstance(x, _NUMBER) for x in v)
        else:
            ok = isinstance(v, kind) and not isinstance(v, bool)
        if not ok:
            want = {"times": "an object of numbers", "list": "a list of numbers", _NUMBER: "a number",
                    "int?": "an integer or null",
                    int: "an integer", str: "a string"}[kind]
            raise ValueError(f"{path}: cells[{i}].{k} is {json.dumps(v)[:40]}; expected {want}")


def _check_backend(path: Path, data: dict) -> None:
    if not isinstance(data["info"].get("backend"), str):   # the targets the report states depend on it
        raise ValueError(f"{path}: info lacks its 'backend' (cpu, cuda or metal)")


_CELL_KINDS = dict(shape=str, tokens=int, dtype=str, variant=str, implementation=str, us_per_layer="times",
                   bytes_per_layer=_NUMBER)


def load_json(path: Path) -> tuple[list[Cell], dict]:
    """Cells and the whole document of a --json file; a malformed file is named with what is missing."""
    data = _read_doc(path, "bench --json")
    cells = []
    for i, c in enumerate(data["cells"]):
        missing = [k for k in _CELL_FIELDS if not isinstance(c, dict) or k not in c]
        if missing:
            raise ValueError(f"{path}: cells[{i}] lacks {', '.join(missing)}")
        c = dict(c, eval_us_per_layer=c.get("eval_us_per_layer", {}))
        _check_values(path, i, c, dict(_CELL_KINDS, eval_us_per_layer="times"))
        cells.append(Cell(**{k: c[k] for k in _CELL_FIELDS}, eval_us_per_layer=c["eval_us_per_layer"]))
    _check_backend(path, data)
    return cells, data


def by_tokens(cells: list[Cell]) -> list[dict]:
    """Per T: medians of the times over the cells at that T in the targets' dtypes (bf16/f16 when
    measured, else all), and the extremes that the targets look at."""
    rows = []
    for T in sorted({c.tokens for c in cells}):
        at = [c for c in cells if c.tokens == T]
        half = [c for c in at if c.dtype in HALF] or at
        sp = [c.speedup_vs_mlx() for c in at if c.speedup_vs_mlx() is not None]
        rows.append(dict(
            tokens=T, cells=len(at),
            **{case: _median(c.us_per_layer.get(case) for c in half) for case in ("fused", "mlx", "seed_loop",
                                                                                  "trivial", "copy")},
            speedup_median=_median(sp), speedup_min=min(sp) if sp else None,
            ratio_trivial_median=_median(c.ratio_to_trivial() for c in half),
            ratio_trivial_eval_median=_median(c.ratio_to_trivial("eval") for c in half),
            share_median=_median(c.bandwidth_share() for c in half),
            share_min=min((c.bandwidth_share() for c in half if c.bandwidth_share()), default=None)))
    return rows


def markdown(cells: list[Cell], info: dict, command: str) -> str:
    """The key results of one run as markdown (docs/benchmarks/README.md quotes these)."""
    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    impls = sorted({c.implementation for c in cells})
    dtypes = sorted({c.dtype for c in cells})
    lines = [f"- Date {info.get('date', '?')}; host {info.get('host')} ({info.get('cpu') or info.get('platform')}, "
             f"{info.get('cpu_count')} CPUs); GPU: {info.get('gpu') or 'none'}; device {info.get('device')}; "
             f"MLX {info.get('mlx')}; Python {info.get('python')}; commit {info.get('commit')}; "
             f"fused ran as {', '.join(impls)}.",
             f"- Command: `{command}`",
             f"- {len(cells)} cells; dtypes {', '.join(dtypes)}. Medians per T over shapes and variants "
             f"({'bf16/f16' if set(dtypes) & set(HALF) else 'all dtypes'}) in µs per layer; speedup over all "
             f"dtypes; 'eval' excludes building the graph in Python.", "",
             "| T | fused | MLX path | seed loop | trivial op | copy | speedup vs MLX (median / min) | "
             "fused ÷ trivial (step / eval) | share of copy bandwidth (median / min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in by_tokens(cells):
        lines.append(f"| {r['tokens']} | {f(r['fused'], '.1f')} | {f(r['mlx'], '.1f')} | {f(r['seed_loop'], '.1f')} | "
                     f"{f(r['trivial'], '.1f')} | {f(r['copy'], '.1f')} | {f(r['speedup_median'], '.2f')} / "
                     f"{f(r['speedup_min'], '.2f')} | {f(r['ratio_trivial_median'], '.2f')} / "
                     f"{f(r['ratio_trivial_eval_median'], '.2f')} | {f(r['share_median'], '.2f')} / "
                     f"{f(r['share_min'], '.2f')} |")
    lines += ["", "| target | result | evidence |", "|---|---|---|"]
    for name, met, evidence in targets(cells, info.get("backend", "")):
        lines.append(f"| {name} | **{'met' if met else 'not met'}** | {evidence} |")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, cells: list[Cell], info: dict, command: str) -> None:
    text = markdown(cells, info, command)
    atomic_write(path, lambda fh: fh.write(text.encode()))


def plot(path: Path, cells: list[Cell], title: str, backend: str) -> None:
    """Three panels against T, one line per shape (median over variants and dtypes, band = min..max):
    speedup vs MLX's path, fused ÷ trivial op, and share of the copy bandwidth, with the targets
    drawn; every y axis linear from 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = (
        ("speedup vs MLX's own path (x)", lambda c: c.speedup_vs_mlx(), False,
         "fused vs mx.fast.rope + 2 scatters\n(all dtypes and variants)"),
        ("fused time ÷ trivial op time", lambda c: c.ratio_to_trivial(), True,
         "distance from the per-op floor\n(bf16/f16 when measured)"),
        ("share of measured copy bandwidth", lambda c: c.bandwidth_share(), True,
         "achieved bandwidth / copy floor\n(bf16/f16 when measured)"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    shapes = sorted({c.shape for c in cells})
    ts = sorted({c.tokens for c in cells})
    colors = dict(zip(shapes, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, (ylabel, metric, half_only, subtitle) in zip(axes, panels):
        pool = [c for c in cells if c.dtype in HALF] if half_only and any(c.dtype in HALF for c in cells) else cells
        for shape in shapes:
            pts = {}
            for c in pool:
                if c.shape == shape and metric(c) is not None:
                    pts.setdefault(c.tokens, []).append(metric(c))
            if not pts:
                continue
            xs = sorted(pts)
            ax.plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", color=colors[shape], label=shape)
            ax.fill_between(xs, [min(pts[x]) for x in xs], [max(pts[x]) for x in xs], color=colors[shape], alpha=0.15)
        ax.set(xscale="log", xlabel="tokens per step (T)", ylabel=ylabel, title=subtitle)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=1.0, label="MLX's path (1x)")
    axes[1].axhline(1.0, color="k", lw=1.0)
    if backend == "cpu":
        axes[0].hlines(CPU_MIN_SPEEDUP, ts[0], max([t for t in ts if t <= CPU_MAX_T] or ts[:1]), color="r", ls="--",
                       label=f"CPU target {CPU_MIN_SPEEDUP:g}x (T <= {CPU_MAX_T})")
    else:  # the GPU targets
        axes[1].axhline(DECODE_MAX_RATIO, color="r", ls="--", label=f"target <= {DECODE_MAX_RATIO}x (T <= {DECODE_MAX_T})")
        axes[2].axhline(PREFILL_MIN_SHARE, color="r", ls="--",
                        label=f"target >= {PREFILL_MIN_SHARE:.0%} (T >= {PREFILL_MIN_T})")
    for ax in axes[:2]:       # ratios on a linear axis from 0: a bar's height is the ratio
        ax.set_ylim(0, ax.get_ylim()[1])
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda t, _: f"{t:g}x"))
    half = [c for c in cells if c.dtype in HALF] or cells   # what panel 3 shows
    axes[2].set_ylim(0, max(1.2, max((c.bandwidth_share() or 0 for c in half), default=0) * 1.05))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda fh: fig.savefig(fh, dpi=110, format="png"))
    plt.close(fig)


# ----------------------------------------------------------------------------- end-to-end (bench --e2e)

# Targets of the end-to-end issue (docs/benchmarks/README.md).
E2E_GPU_FUSED_OVER_MODULE = 1.10    # GPU: fused >= 1.10x module in every cell
E2E_B1_MODULE_WITHIN = 0.10         # GPU, batch 1: module within 10% of mlx_lm ...
E2E_DROP_IN_B1, E2E_DROP_IN_SIZE = 1.05, "llama-8b"   # GPU: the drop-in cache >= 1.05x stock at batch 1, 8B-like
E2E_MODE_ORDER = ("mlx_lm", "mlx_lm_fused_cache", "module", "reference", "fused")


def _kv(bits) -> str:
    """A cache's format in tables and labels: 'bf16' style names are the dtype's; quantized 'q8'."""
    return "-" if bits is None else f"q{bits}"


def e2e_progress_row(c) -> str:
    return (f"  {c.size:<12}{c.dtype:>9} b{c.batch:<3} p{c.prompt:<5} {c.mode:<19}{_kv(c.kv_bits):>3} decode "
            f"{c.decode_tokens_per_s:9.1f} tok/s ({c.decode_ms_per_step:7.2f} ms/step)  prefill "
            f"{c.prefill_tokens_per_s:9.0f} tok/s" + (f"  KV peak {c.kv_peak_bytes / 2**20:.1f} MiB, buffers "
                                                       f"{c.kv_cache_bytes / 2**20:.1f} MiB"
                                                       if c.kv_peak_bytes is not None and c.kv_cache_bytes is not None
                                                       else ""))


def _e2e_groups(cells) -> dict[tuple, dict]:
    """(size, dtype, batch, prompt, kv_bits) -> {mode: cell}, in measurement order."""
    groups: dict[tuple, dict] = {}
    for c in cells:
        groups.setdefault((c.size, c.dtype, c.batch, c.prompt, c.kv_bits), {})[c.mode] = c
    return groups


def _float_groups(groups: dict) -> dict:
    """The groups of the float cache (kv_bits None): what the targets of the unquantized issues judge."""
    return {k: g for k, g in groups.items() if k[4] is None}


def _paired_cells(x, y) -> list[float]:
    """Per round, x's decode speed over y's (y's time / x's time). The variants of a round run one
    after the other, so a round's pair shares the host's state: on a host whose speed drifts between
    rounds the per-round ratios scatter far less than the per-variant medians do."""
    if not x or not y or len(x.decode_s) != len(y.decode_s) or not all(t > 0 for t in x.decode_s):
        return []
    return [ty / tx for tx, ty in zip(x.decode_s, y.decode_s)]


def _cell_ratio(x, y) -> float | None:
    """x's decode speed over y's: the median of the per-round ratios (_paired_cells) when both cells
    have the same rounds, else the ratio of the two medians."""
    pairs = _paired_cells(x, y)
    if pairs:
        return _median(pairs)
    return x.decode_tokens_per_s / y.decode_tokens_per_s if x and y and y.decode_tokens_per_s else None


def _paired(group: dict, a: str, b: str) -> list[float]:
    """_paired_cells of modes a and b of one group."""
    return _paired_cells(group.get(a), group.get(b))


def _ratio(group: dict, a: str, b: str) -> float | None:
    """_cell_ratio of modes a and b of one group."""
    return _cell_ratio(group.get(a), group.get(b))


def _float_twin(groups: dict, key: tuple, mode: str = "mlx_lm_fused_cache"):
    """The cell of `mode` on the float cache of a group's size, dtype, batch and prompt, or None."""
    return groups.get((*key[:4], None), {}).get(mode)


def _over_float(groups: dict, key: tuple, mode: str = "mlx_lm_fused_cache") -> float | None:
    """A quantized group's `mode` over the same mode on the float cache of the same size, dtype,
    batch and prompt (None for a float group or without that cell)."""
    if key[4] is None:
        return None
    return _cell_ratio(groups[key].get(mode), _float_twin(groups, key, mode))


def _e2e_modes(cells) -> list[str]:
    present = {c.mode for c in cells}
    return [m for m in E2E_MODE_ORDER if m in present]


def e2e_table(cells) -> str:
    """Decode tokens/s per cell and mode, then fused/module, module/mlx_lm, fused/mlx_lm and
    mlx_lm_fused_cache/mlx_lm (each the median of the per-round ratios, _ratio); a quantized row (kv
    q8, q4) adds the drop-in over the drop-in on the float cache (cache/float)."""
    modes = _e2e_modes(cells)
    groups = _e2e_groups(cells)
    head = (f"{'size':<12}{'dtype':>9}{'batch':>6}{'prompt':>7}{'kv':>4}" + "".join(f"{m:>20}" for m in modes)
            + f"{'fused/module':>14}{'module/mlx':>12}{'fused/mlx':>11}{'cache/mlx':>11}{'cache/float':>12}")
    lines = [head]
    for key, g in groups.items():
        size, dtype, batch, prompt, bits = key
        lines.append(f"{size:<12}{dtype:>9}{batch:>6}{prompt:>7}{_kv(bits):>4}"
                     + "".join(_f(g[m].decode_tokens_per_s if m in g else None, "20.1f") for m in modes)
                     + _f(_ratio(g, "fused", "module"), "14.2f") + _f(_ratio(g, "module", "mlx_lm"), "12.2f")
                     + _f(_ratio(g, "fused", "mlx_lm"), "11.2f") + _f(_ratio(g, "mlx_lm_fused_cache", "mlx_lm"), "11.2f")
                     + _f(_over_float(groups, key), "12.2f"))
    return "\n".join(lines)


def _e2e_name(key: tuple) -> str:
    size, dtype, batch, prompt, bits = key
    return f"{size} {dtype} b{batch} p{prompt}" + ("" if bits is None else f" {_kv(bits)}")


def _all_cells_target(groups, name, a, b, minimum, keys=None) -> tuple[str, bool, str] | None:
    pairs = [(k, _ratio(g, a, b)) for k, g in groups.items() if keys is None or k in keys]
    pairs = [(k, r) for k, r in pairs if r is not None]
    if not pairs:
        return None
    under = [(k, r) for k, r in pairs if r < minimum]
    worst = min(pairs, key=lambda kr: kr[1])
    return (name, not under, f"{len(pairs) - len(under)}/{len(pairs)} cells at or above; worst {worst[1]:.2f}x "
                             f"({_e2e_name(worst[0])}); median {_median(r for _, r in pairs):.2f}x"
                             + (f"; under: {', '.join(f'{_e2e_name(k)} {r:.2f}x' for k, r in under[:6])}"
                                + (f" and {len(under) - 6} more" if len(under) > 6 else "") if under else ""))


def e2e_targets(cells, backend: str) -> list[tuple[str, bool, str]]:
    """(target, met, evidence) of the end-to-end issues' targets that apply to `backend`: the float
    cache's (its groups only), then the quantized cache's (issue 35)."""
    every = _e2e_groups(cells)
    groups = _float_groups(every)
    quant = {k: g for k, g in every.items() if k[4] is not None}
    out = []
    t = _all_cells_target(quant, "quantized drop-in >= stock mlx-lm's QuantizedKVCache (every cell both ran)",
                          "mlx_lm_fused_cache", "mlx_lm", 1.0)
    qt = [t] if t else []
    if backend == "cpu":
        t = _all_cells_target(groups, "CPU: fused >= module (every cell)", "fused", "module", 1.0)
        out += [t] if t else []
        return out + qt
    t = _all_cells_target(groups, f"fused >= {E2E_GPU_FUSED_OVER_MODULE:.2f}x module (every cell)", "fused",
                          "module", E2E_GPU_FUSED_OVER_MODULE)
    out += [t] if t else []
    b1 = {k for k in groups if k[2] == 1}
    t = _all_cells_target(groups, f"batch 1: module within {E2E_B1_MODULE_WITHIN:.0%} of mlx_lm", "module",
                          "mlx_lm", 1.0 - E2E_B1_MODULE_WITHIN, b1)
    out += [t] if t else []
    t = _all_cells_target(groups, "batch 1: fused >= mlx_lm", "fused", "mlx_lm", 1.0, b1)
    out += [t] if t else []
    big = {k for k in b1 if k[0] == E2E_DROP_IN_SIZE}
    t = _all_cells_target(groups, f"drop-in cache: mlx_lm_fused_cache >= {E2E_DROP_IN_B1:.2f}x mlx_lm at batch 1 "
                          f"({E2E_DROP_IN_SIZE})", "mlx_lm_fused_cache", "mlx_lm", E2E_DROP_IN_B1, big)
    out += [t] if t else []
    t = _all_cells_target(groups, "drop-in cache: mlx_lm_fused_cache never slower than mlx_lm (every cell)",
                          "mlx_lm_fused_cache", "mlx_lm", 1.0)
    out += [t] if t else []
    return out + qt + _kv_memory_target(every)


E2E_KV_MEMORY_WITHIN = 0.10     # GPU: the quantized drop-in's KV memory within 10% of the format's share
_ITEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_ideal(bits: int, group_size: int, dtype: str) -> float:
    """The quantized format's bytes over the float cache's: bits / 8 bytes of words per feature, a scale
    and a bias of the dtype per group, over the dtype's item size (bf16, 8-bit: 0.5625 at group 32, 0.53125 at 64)."""
    item = _ITEM[dtype]
    return (bits / 8 + 2 * item / group_size) / item


def _kv_share(groups: dict, key: tuple) -> float | None:
    """The quantized drop-in's decode-phase KV memory over the float drop-in's (kv_decode_peak_bytes)."""
    q = groups[key].get("mlx_lm_fused_cache")
    f = _float_twin(groups, key)
    if key[4] is None or not q or not f or not q.kv_decode_peak_bytes or not f.kv_decode_peak_bytes:
        return None
    return q.kv_decode_peak_bytes / f.kv_decode_peak_bytes


def _kv_memory_target(groups: dict) -> list[tuple[str, bool, str]]:
    rows = [(k, share, kv_ideal(k[4], groups[k]["mlx_lm_fused_cache"].kv_group_size, k[1]))
            for k in groups if (share := _kv_share(groups, k)) is not None]
    if not rows:
        return []
    off = [(k, s, i) for k, s, i in rows if abs(s / i - 1) > E2E_KV_MEMORY_WITHIN]
    worst = max(rows, key=lambda r: abs(r[1] / r[2] - 1))
    return [(f"quantized drop-in: KV memory (decode peak less the start) within {E2E_KV_MEMORY_WITHIN:.0%} of the "
             f"format's share of the float drop-in's", not off,
             f"{len(rows) - len(off)}/{len(rows)} cells within; worst {worst[1]:.3f} vs {worst[2]:.3f} "
             f"({_e2e_name(worst[0])})" + (f"; off: {', '.join(f'{_e2e_name(k)} {s:.3f} vs {i:.3f}' for k, s, i in off[:6])}"
                                           if off else ""))]


def write_e2e_json(path: Path, cells, skipped: list[dict], info: dict, command: str) -> None:
    doc = {"info": info, "command": command, "cells": [c.to_json() for c in cells], "skipped": skipped,
           "targets": [dict(target=n, met=m, evidence=e) for n, m, e in e2e_targets(cells, info.get("backend", ""))]}
    atomic_write(path, lambda fh: fh.write(json.dumps(doc, indent=1).encode()))


def load_e2e_json(path: Path):
    """(cells, document) of a `bench --e2e --json` file; a malformed file is named with what is missing."""
    import dataclasses

    from .e2e import E2ECell

    data = _read_doc(path, "bench --e2e --json")
    names = [f.name for f in dataclasses.fields(E2ECell)]
    optional = ("floor_tokens_per_s", "prompt_lengths",        # files written before the decode-attention work
                "kv_bits", "kv_group_size", "kv_peak_bytes",       # ... before issue 35's (kv_group_size: quantized)
                "kv_decode_peak_bytes", "kv_cache_bytes")
    cells = []
    for i, c in enumerate(data["cells"]):
        missing = [k for k in names if (not isinstance(c, dict) or k not in c) and k not in optional]
        if missing:
            raise ValueError(f"{path}: cells[{i}] lacks {', '.join(missing)} (not a `bench --e2e --json` file?)")
        _check_values(path, i, c, _E2E_KINDS)
        if c.get("kv_bits") is not None and not isinstance(c.get("kv_group_size"), int):
            raise ValueError(f"{path}: cells[{i}] has kv_bits {c['kv_bits']} but no kv_group_size")
        cells.append(E2ECell(**{k: c[k] for k in names if k in c}))
    skipped = data.get("skipped", [])
    if not isinstance(skipped, list) or not all(isinstance(s, dict) and isinstance(s.get("mode"), str)
                                                and isinstance(s.get("reason"), str) for s in skipped):
        raise ValueError(f"{path}: 'skipped' is not a list of objects with a mode and a reason")
    _check_backend(path, data)
    return cells, data


_E2E_KINDS = dict(size=str, batch=int, prompt=int, dtype=str, mode=str, decode_tokens=int,
                  decode_tokens_per_s=_NUMBER, prefill_tokens_per_s=_NUMBER, decode_ms_per_step=_NUMBER, rounds=int,
                  decode_s="list", prefill_s="list", implementation=str, floor_tokens_per_s=_NUMBER,
                  prompt_lengths="list", kv_bits="int?", kv_group_size=int, kv_peak_bytes="int?",
                  kv_decode_peak_bytes="int?", kv_cache_bytes="int?")


def _quartiles(x, y) -> str:
    """_cell_ratio of x over y, with the quartiles of the per-round ratios when there are at least two
    rounds."""
    r = _cell_ratio(x, y)
    if r is None:
        return "-"
    pairs = _paired_cells(x, y)
    if len(pairs) < 2:
        return f"{r:.2f}"
    q1, _, q3 = statistics.quantiles(pairs, n=4, method="inclusive")
    return f"{r:.2f} [{q1:.2f}-{q3:.2f}]"


def _with_quartiles(group: dict, a: str, b: str) -> str:
    """_quartiles of modes a and b of one group."""
    return _quartiles(group.get(a), group.get(b))


def _spread(cells) -> str:
    ratios = [max(c.decode_s) / min(c.decode_s) for c in cells if c.decode_s and min(c.decode_s) > 0]
    return f"median {_median(ratios):.2f}x, max {max(ratios):.2f}x" if ratios else "one round"


def _floor_share(g: dict, modes) -> str:
    """The cell's floor_tokens_per_s and each mode's share of it ('-' for files without a floor)."""
    floor = next((c.floor_tokens_per_s for c in g.values() if getattr(c, "floor_tokens_per_s", 0)), 0)
    if not floor:
        return "-"
    return f"{floor:.0f} (" + ", ".join(f"{100 * g[m].decode_tokens_per_s / floor:.0f}%" if m in g else "-"
                                       for m in modes) + ")"


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _kv_memory(g: dict, modes) -> str:
    """Per mode: KV peak / decode peak / buffers in MiB (the e2e module docstring's KV memory)."""
    return ", ".join("-" if m not in g else f"{_mib(g[m].kv_peak_bytes)} / {_mib(g[m].kv_decode_peak_bytes)} / "
                                            f"{_mib(g[m].kv_cache_bytes)}" for m in modes)


def _skipped_key(s: dict) -> tuple:
    return (s["size"], s["dtype"], s["batch"], s["prompt"], s.get("kv_bits"))


def e2e_markdown(cells, skipped: list[dict], info: dict, command: str) -> str:
    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    modes = _e2e_modes(cells) or [m for m in E2E_MODE_ORDER if m in {s["mode"] for s in skipped}]
    groups = _e2e_groups(cells)
    gone = {(*_skipped_key(s), s["mode"]) for s in skipped}
    keys = list(dict.fromkeys([*groups, *map(_skipped_key, skipped)]))
    first = {k[:2]: i for i, k in reversed(list(enumerate(keys)))}      # sizes and dtypes in run order
    keys.sort(key=lambda k: (first[k[:2]], k[2], k[3], k[4] is not None, -(k[4] or 0)))
    bits = sorted({k[4] for k in keys if k[4] is not None})
    group_sizes = sorted({c.kv_group_size for c in cells if c.kv_bits is not None}
                         | {s["kv_group_size"] for s in skipped if s.get("kv_bits") is not None})
    lines = [f"- Date {info.get('date', '?')}; host {info.get('host')} ({info.get('cpu') or info.get('platform')}, "
             f"{info.get('cpu_count')} CPUs); GPU: {info.get('gpu') or 'none'}; device {info.get('device')}; "
             f"MLX {info.get('mlx')}; Python {info.get('python')}; commit {info.get('commit')}; "
             f"{info.get('seconds', '?')} s.",
             f"- Command: `{command}`",
             f"- Greedy decode tokens/s of the whole batch (median of {info.get('matrix', {}).get('rounds', '?')} "
             f"interleaved rounds, {info.get('matrix', {}).get('decode_tokens', '?')} tokens per request); random "
             f"weights; sizes: " + "; ".join(f"{k}: {v}" for k, v in info.get("sizes", {}).items()) + ". "
             "A ratio of two modes is the median over rounds of the ratio within each round (the modes of a round "
             "run back to back); the drop-in cache's column adds the quartiles of those per-round ratios.",
             *([f"- kv: the cache's format: '-' the float cache, "
                + ", ".join(f"q{b}" for b in bits) + f" mlx-lm's quantized format ({', '.join(f'{b} bits' for b in bits)}, "
                f"group size {', '.join(map(str, group_sizes))}); every format's variants run in the same rounds. "
                "'drop-in ÷ float drop-in': the quantized drop-in over the drop-in on the float cache of the same "
                "size, dtype, batch and prompt. 'KV ÷ float (format)': the quantized drop-in's KV decode peak over "
                "the float drop-in's, and the format's share (bits / 8 + 2 x item / group) / item."] if bits else []),
             "- KV MiB: the peak of MLX's active memory over the run less what was active when it started (the "
             "weights; an engine mode's own pools are added back) / the same from the first generated token on / "
             "the cache's buffers at the end (nbytes): the first two include the run's transient arrays "
             "(activations, logits; the first also prefill's attention scores).",
             *[f"- Check: {c}" for c in info.get("checks", [])],
             f"- Round-to-round spread (slowest / fastest decode of a cell and mode): {_spread(cells)}; load average "
             f"at start {info.get('loadavg_start', '?')}, at end {info.get('loadavg_end', '?')}.", "",
             "| size | dtype | batch | prompt | kv | " + " | ".join(modes) + " | fused/module | module/mlx_lm | "
             "fused/mlx_lm | mlx_lm_fused_cache/mlx_lm [quartiles] | drop-in ÷ float drop-in [quartiles] | "
             "KV ÷ float (format) | floor tok/s (share: " + ", ".join(modes) + ") | prefill tok/s (" + ", ".join(modes)
             + ") | KV MiB: peak / decode peak / buffers (" + ", ".join(modes) + ") |",
             "|" + "---|" * (14 + len(modes))]
    for key in keys:
        g = groups.get(key, {})
        size, dtype, batch, prompt, kv_bits = key
        share = _kv_share(groups, key) if key in groups else None
        ideal = kv_ideal(kv_bits, g["mlx_lm_fused_cache"].kv_group_size, dtype) if share is not None else None
        over_float = (_quartiles(g.get("mlx_lm_fused_cache"), _float_twin(groups, key))
                      if kv_bits is not None else "-")
        lines.append(f"| {size} | {dtype} | {batch} | {prompt} | {_kv(kv_bits)} | "
                     + " | ".join(f(g[m].decode_tokens_per_s, ".1f") if m in g else
                                  "skipped" if (*key, m) in gone else "-" for m in modes)
                     + f" | {f(_ratio(g, 'fused', 'module'), '.2f')} | {f(_ratio(g, 'module', 'mlx_lm'), '.2f')} | "
                       f"{f(_ratio(g, 'fused', 'mlx_lm'), '.2f')} | {_with_quartiles(g, 'mlx_lm_fused_cache', 'mlx_lm')} | "
                       f"{over_float} | " + (f"{share:.3f} ({ideal:.3f})" if share is not None else "-") + " | "
                     + _floor_share(g, modes) + " | "
                     + " / ".join(f(g[m].prefill_tokens_per_s if m in g else None, ".0f") for m in modes) + " | "
                     + _kv_memory(g, modes) + " |")
    lines += ["", "| target | result | evidence |", "|---|---|---|"]
    for name, met, evidence in e2e_targets(cells, info.get("backend", "")):
        lines.append(f"| {name} | **{'met' if met else 'not met'}** | {evidence} |")
    reasons = {}
    for s in skipped:
        what = "" if s.get("kv_bits") is None else f" {_kv(s['kv_bits'])}"
        reasons.setdefault((s["mode"] + what, s["reason"]), []).append(
            f"{s['size']} {s['dtype']} b{s['batch']} p{s['prompt']}")
    for (mode, why), where in reasons.items():
        lines.append(f"\n- Skipped `{mode}` ({len(where)} cell{'s' if len(where) > 1 else ''}: {', '.join(where)}): {why}")
    return "\n".join(lines) + "\n"


def write_e2e_markdown(path: Path, cells, skipped: list[dict], info: dict, command: str) -> None:
    text = e2e_markdown(cells, skipped, info, command)
    atomic_write(path, lambda fh: fh.write(text.encode()))


_MODE_LABELS = {"mlx_lm_fused_cache": "drop-in cache in mlx-lm's own loop", "module": "slot engine, module",
                "reference": "slot engine, reference", "fused": "slot engine, fused", "mlx_lm": "stock mlx-lm"}


def e2e_plot(path: Path, cells, title: str) -> None:
    """e2e_figure as a PNG."""
    import matplotlib.pyplot as plt

    fig = e2e_figure(cells, title)
    atomic_write(path, lambda fh: fig.savefig(fh, dpi=100, format="png", bbox_inches="tight"))
    plt.close(fig)


def e2e_figure(cells, title: str):
    """Each mode's decode speed over stock mlx-lm's (the median of the per-round ratios, with their
    quartiles as whiskers), a bar per mode and cell, on a linear axis from 0 with the 1.0 line: a
    bar's height is the ratio itself. Without mlx_lm cells the first mode measured is the base."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = _e2e_modes(cells)
    base = "mlx_lm" if "mlx_lm" in modes else modes[0]
    shown = [m for m in modes if m != base]
    groups = list(_e2e_groups(cells).items())
    dtypes, prompts = {k[1] for k, _ in groups}, {k[3] for k, _ in groups}
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    labels = [f"{size}\nb{batch}" + (f" p{prompt}" if len(prompts) > 1 else "")
              + (f" {short.get(dtype, dtype)}" if len(dtypes) > 1 else "") + ("" if bits is None else f" {_kv(bits)}")
              for (size, dtype, batch, prompt, bits), _ in groups]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.95 * len(groups) + 2), 5.2))
    colors = dict(zip(shown, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    width = 0.8 / max(1, len(shown))
    top = 1.0
    for j, m in enumerate(shown):
        xs, ys, lo, hi = [], [], [], []
        for i, (_, g) in enumerate(groups):
            r = _ratio(g, m, base)
            if r is None:
                continue
            pairs = _paired(g, m, base)
            q1, q3 = (statistics.quantiles(pairs, n=4, method="inclusive")[::2] if len(pairs) >= 2 else (r, r))
            xs.append(i + (j - (len(shown) - 1) / 2) * width)
            ys.append(r)
            lo.append(max(0.0, r - q1))
            hi.append(max(0.0, q3 - r))
            top = max(top, q3, r)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[m], label=_MODE_LABELS.get(m, m),
               error_kw=dict(lw=0.8))
        if m == "mlx_lm_fused_cache":        # the headline: its ratios written on the bars
            for x, y in zip(xs, ys):
                ax.text(x, y / 2, f"{y:.2f}", ha="center", va="center", rotation=90, fontsize=7, color="white")
    for i, (_, g) in enumerate(groups):     # a cell without the base (stock skipped: the markdown says why)
        if base not in g:
            ax.text(i, 0.05, f"no {base}", ha="center", va="bottom", rotation=90, fontsize=7)
    ax.axhline(1.0, color="k", lw=1.2, label=f"{_MODE_LABELS.get(base, base)} (1.0)")
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel(f"decode tokens/s ÷ {_MODE_LABELS.get(base, base)}'s")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(shown) + 1, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.set_title(title + "\nmedian of the per-round ratios; whiskers: their quartiles", fontsize=9)
    fig.tight_layout()
    return fig


def dropin_summary(cells) -> str | None:
    """The drop-in cache against stock mlx-lm on the float cache as a small markdown table (the
    README's): a row per size (and dtype and prompt where several), a column per batch; None without
    both modes."""
    a, b = "mlx_lm_fused_cache", "mlx_lm"
    rows: dict[tuple, dict[int, str]] = {}
    for (size, dtype, batch, prompt, _), g in _float_groups(_e2e_groups(cells)).items():
        r = _ratio(g, a, b)
        if r is not None:
            rows.setdefault((size, dtype, prompt), {})[batch] = (
                f"**{r:.2f}x** ({g[b].decode_tokens_per_s:.0f} → {g[a].decode_tokens_per_s:.0f})")
    if not rows:
        return None
    batches = sorted({bt for r in rows.values() for bt in r})
    several = lambda i: len({k[i] for k in rows}) > 1
    lines = ["| model | " + " | ".join(f"batch {bt}" for bt in batches) + " |", "|---" * (len(batches) + 1) + "|"]
    for (size, dtype, prompt), by in rows.items():
        name = size + (f" {dtype}" if several(1) else "") + (f", {prompt}-token prompts" if several(2) else "")
        lines.append(f"| {name} | " + " | ".join(by.get(bt, "-") for bt in batches) + " |")
    return "\n".join(lines)
