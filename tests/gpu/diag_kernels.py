"""Probe (not a test): the GPU time of one decode step's kernels, per kernel name, with mlx-lm's own
cache or the drop-in fused cache, measured by Nsight Compute (each kernel's gpu__time_duration;
launch gaps between graph nodes are not included). The probe profiles only its timed steps
(cuProfilerStart/Stop around them), every step evaluated on its own. With --batch B > 1 the B
requests are prefilled one by one and their caches merged into the batch caches mlx-lm's
BatchGenerator decodes with (BatchKVCache / BatchRotatingKVCache, the cache classes' own merge).

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file K.csv \
        python3 tests/gpu/diag_kernels.py --size llama-8b --layers 4 --cache fused_cache --steps 3 [--batch 32]
    python3 tests/gpu/diag_kernels.py --summarize K.csv --steps 3 --layers 4

docs/benchmarks/e2e-root-cause.md.
"""
import argparse
import csv
import ctypes
import sys
from collections import defaultdict

p = argparse.ArgumentParser()
p.add_argument("--size", default="llama-8b")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--cache", default="fused_cache", choices=("mlx_lm", "fused_cache"))
p.add_argument("--steps", type=int, default=3)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--batch", type=int, default=1, help="decode B requests in mlx-lm's batch caches (not with --prefill)")
p.add_argument("--prefill", action="store_true", help="profile prefills of --prompt tokens (a fresh cache each) instead")
p.add_argument("--summarize", metavar="CSV", help="print per-step, per-layer kernel times from an ncu CSV log")
args = p.parse_args()
if args.batch < 1 or (args.batch > 1 and args.prefill):
    p.error(f"argument --batch: {args.batch}: expected an integer >= 1, and 1 with --prefill")


def summarize(path: str) -> None:
    per_name, n = defaultdict(float), defaultdict(int)
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if len(r) > 10]
    except OSError as e:
        sys.exit(f"--summarize {path}: cannot read it ({e.strerror}); pass the --log-file of an ncu --csv run")
    cols = ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit")
    if not rows or not all(c in rows[0] for c in cols):
        sys.exit(f"--summarize {path}: no ncu --csv table with the columns {', '.join(cols)} (did ncu profile "
                 f"any kernel? it needs --profile-from-start off and this probe's timed steps)")
    head = rows[0]
    name_at, metric_at, value_at, unit_at = (head.index(c) for c in cols)
    for r in rows[1:]:
        if r[metric_at] != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r[unit_at]]
        name = r[name_at].split("(")[0].split("<")[0][:60]
        per_name[name] += float(r[value_at].replace(",", "")) * scale
        n[name] += 1
    total = sum(per_name.values())
    print(f"{path}: {sum(n.values())} kernels, {total / args.steps:.1f} us per step, "
          f"{total / args.steps / args.layers:.2f} us per layer-step (incl. the head)")
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1]):
        print(f"  {us / args.steps:9.2f} us/step  {n[name] / args.steps:6.1f} calls/step  {name}")


if args.summarize:
    summarize(args.summarize)
    sys.exit(0)

import mlx.core as mx  # noqa: E402

from benchmarks.e2e import SIZES, as_shipped, random_model  # noqa: E402
from registry.integrations.mlx_lm import make_own_cache, make_prompt_cache  # noqa: E402

try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    sys.exit(f"diag_kernels: libcuda.so.1 is not loadable ({e}); run it on the GPU host under ncu (see above)")
model = random_model(dict(SIZES[args.size].config, num_hidden_layers=args.layers), mx.bfloat16)
make = make_prompt_cache if args.cache == "fused_cache" else make_own_cache
with as_shipped(args.cache, model):
    per_request = [make(model) for _ in range(args.batch)]
    ys = [mx.argmax(model(mx.array([[1 + b] * args.prompt]), cache=c)[:, -1], axis=-1)
          for b, c in enumerate(per_request)]
    mx.eval(ys)
    if args.batch == 1:
        cache, y = per_request[0], ys[0]
    else:
        cache = [layer[0].merge(list(layer)) for layer in zip(*per_request)]
        y = mx.concatenate(ys)
    for _ in range(3):                                   # warm: plans bound, graphs cached
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    mx.synchronize()
    cuda.cuProfilerStart()
    for _ in range(args.steps):
        if args.prefill:
            y = mx.argmax(model(mx.array([[1] * args.prompt]), cache=make(model))[:, -1], axis=-1)
        else:
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    mx.synchronize()
    cuda.cuProfilerStop()
print(f"{args.size} x{args.layers} layers, {args.cache}, batch {args.batch}: {args.steps} "
      f"{'prefills' if args.prefill else 'steps'} profiled", flush=True)
