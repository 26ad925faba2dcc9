"""A batch-1 decode step of mlx-lm's own loop with mlx-lm's caches (`mlx_lm`) and with the drop-in
fused cache (`fused`), on the current device: the pipelined step (generate_step's pattern: build and
queue step n+1, then read token n), the host's part of it (build + queue) and the wait for the GPU
(step - host, median of each). Under Nsight Compute's graph profiling (--ncu) it instead runs 3
steps (or 3 prefills of fresh caches, --prefill) of one cache inside cuProfilerStart/Stop, each
evaluated on its own, so that ncu times every CUDA graph MLX launches as one workload: the GPU's time
per step including the gaps between its kernels, which per-kernel times leave out.
docs/benchmarks/e2e-root-cause.md, "Open".

    python -m benchmarks.graph_time --size llama-1b [--rounds 4] [--steps 48]
    ncu --graph-profiling graph --cache-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum --csv --log-file G.csv \\
        python -m benchmarks.graph_time --size llama-1b --ncu --cache fused [--prefill]
    python -m benchmarks.graph_time --summarize G.csv
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import os
import sys
import time

CACHES = ("mlx_lm", "fused")
PROMPT, NCU_STEPS = 128, 3
_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def summarize(path: str) -> str:
    """Total gpu__time_duration of an ncu --csv log per step (NCU_STEPS steps were profiled)."""
    if os.path.exists(path) and not os.path.isfile(path):   # a FIFO or a device would block the read
        raise SystemExit(f"--summarize {path}: not a regular file")
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if len(r) > 5]
    except OSError as e:
        raise SystemExit(f"--summarize {path}: cannot read it ({e.strerror})")
    except (UnicodeDecodeError, csv.Error) as e:
        raise SystemExit(f"--summarize {path}: not an ncu --csv log ({e})")
    cols = ("Metric Name", "Metric Value", "Metric Unit")
    if not rows or not all(c in rows[0] for c in cols):
        raise SystemExit(f"--summarize {path}: no ncu --csv table with the columns {', '.join(cols)}")
    name_at, value_at, unit_at = (rows[0].index(c) for c in cols)
    times = []
    for line, r in enumerate(rows[1:], start=2):
        if r[name_at] != "gpu__time_duration.sum":
            continue
        try:
            times.append(float(r[value_at].replace(",", "")) * _SCALE[r[unit_at]])
        except (ValueError, KeyError):
            raise SystemExit(f"--summarize {path}: row {line}: gpu__time_duration.sum is {r[value_at]!r} "
                             f"{r[unit_at]!r}; expected a number in one of {', '.join(_SCALE)}")
    return f"{path}: {len(times)} workloads, {sum(times) / NCU_STEPS:.1f} us per step ({NCU_STEPS} steps)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.graph_time")
    p.add_argument("--size", default="llama-1b")
    p.add_argument("--cache", default="mlx_lm,fused", help="mlx_lm, fused (--ncu: one of them)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--ncu", action="store_true", help="profile NCU_STEPS steps of one cache for ncu")
    p.add_argument("--prefill", action="store_true", help="with --ncu: profile prefills of fresh caches")
    p.add_argument("--summarize", metavar="CSV", help="print the GPU time per step of an ncu --csv log")
    args = p.parse_args(argv)
    if args.summarize is not None:        # an empty value is a path that does not exist, not "no --summarize"
        print(summarize(args.summarize))
        return
    from .e2e import SIZES
    if args.size not in SIZES:
        p.error(f"--size: unknown {args.size} (choose from {', '.join(SIZES)})")
    caches = args.cache.split(",")
    if set(caches) - set(CACHES):
        p.error(f"--cache: unknown {', '.join(sorted(set(caches) - set(CACHES)))} (choose from {', '.join(CACHES)})")
    if args.ncu and len(caches) != 1:
        p.error("--cache: --ncu profiles one cache at a time")
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps)):
        if value < 1:
            p.error(f"{flag}: {value} is below 1")
    if args.prefill and not args.ncu:
        p.error("--prefill: only with --ncu")

    import mlx.core as mx

    from registry.integrations.mlx_lm import make_own_cache, make_prompt_cache

    from .e2e import as_shipped, random_model

    model = random_model(SIZES[args.size].config, mx.bfloat16)
    makers = {"mlx_lm": make_own_cache, "fused": make_prompt_cache}

    def prefilled(name):
        cache = makers[name](model)
        y = mx.argmax(model(mx.array([[1] * PROMPT]), cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        return cache, y

    def step(y, cache):
        return mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)

    if args.ncu:
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SystemExit(f"--ncu: libcuda.so.1 is not loadable ({e}); run it on the GPU host under ncu")
        name = caches[0]
        with as_shipped(name, model):
            cache, y = prefilled(name)
            for _ in range(3):                       # warm: plans bound, graphs cached
                y = step(y, cache)
                mx.eval(y)
            mx.synchronize()
            cuda.cuProfilerStart()
            for _ in range(NCU_STEPS):
                if args.prefill:
                    y = mx.argmax(model(mx.array([[1] * PROMPT]), cache=makers[name](model))[:, -1], axis=-1)
                else:
                    y = step(y, cache)
                mx.eval(y)
            mx.synchronize()
            cuda.cuProfilerStop()
        return

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    for rnd in range(args.rounds):
        for name in caches:
            with as_shipped(name, model):
                cache, y = prefilled(name)
                steps, host = [], []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    nxt = step(y, cache)
                    mx.async_eval(nxt)
                    t1 = time.perf_counter()
                    y.item()
                    t2 = time.perf_counter()
                    steps.append(t2 - t0), host.append(t1 - t0)
                    y = nxt
                y.item()
            print(f"{args.size} r{rnd} {name:7s} step {1e3 * median(steps):.3f} ms host {1e3 * median(host):.3f} ms "
                  f"wait {1e3 * (median(steps) - median(host)):.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
