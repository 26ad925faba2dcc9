"""Probe (not a test): `bench --e2e`'s own runs of one cell (benchmarks/e2e.Modes.run: mlx-lm's
generate_step at batch 1, its BatchGenerator above) for one or more modes, one process, so that a
tracer sees exactly what the benchmark times. Prints each run's prefill and decode seconds and, with
--profile, the functions with the most own time over the timed runs (Python's view: time inside
mx.eval / .item() is waiting for the device). docs/benchmarks/e2e-root-cause.md.

    PYTHONPATH=. python3 tests/gpu/diag_loop.py --size llama-1b --batch 1 --modes mlx_lm,mlx_lm_fused_cache
    nsys profile -t cuda -o /tmp/fused python3 tests/gpu/diag_loop.py --modes mlx_lm_fused_cache ...
    nsys stats -r cuda_api_sum /tmp/fused.nsys-rep     # API calls (syncs, allocations, graph builds)
"""
import argparse
import cProfile
import pstats

import mlx.core as mx
import numpy as np

from benchmarks.e2e import MODES, SIZES, Modes, pool_needed, random_model, sync

p = argparse.ArgumentParser()
p.add_argument("--size", default="llama-1b")
p.add_argument("--batch", type=int, default=1)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
p.add_argument("--modes", default="mlx_lm,mlx_lm_fused_cache")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--layers", type=int, default=0, help="override the size's layer count")
p.add_argument("--profile", type=int, default=0, help="print the N functions with the most own time")
args = p.parse_args()
for flag, value, least in (("--batch", args.batch, 1), ("--prompt", args.prompt, 1), ("--tokens", args.tokens, 2),
                          ("--rounds", args.rounds, 1), ("--layers", args.layers, 0), ("--profile", args.profile, 0)):
    if value < least:
        p.error(f"{flag}: {value} is below {least}" + (" (a decode rate needs 2 tokens)" if flag == "--tokens" else ""))
if args.size not in SIZES:
    p.error(f"--size: unknown {args.size!r} (choose from {', '.join(SIZES)})")
modes = args.modes.split(",")
if set(modes) - set(MODES):
    p.error(f"--modes: unknown {', '.join(sorted(set(modes) - set(MODES)))} (choose from {', '.join(MODES)})")

config = dict(SIZES[args.size].config, **({"num_hidden_layers": args.layers} if args.layers else {}))
mx.random.seed(0)
model = random_model(config, mx.bfloat16)
rng = np.random.default_rng(1)
prompts = [rng.integers(0, config["vocab_size"], args.prompt).tolist() for _ in range(args.batch)]
runner = Modes(model, modes, pool_needed(args.batch, args.prompt, args.tokens))
for m in runner.modes:                      # untimed, as bench's warm-up
    runner.run(m, prompts, 3)
profs = {m: cProfile.Profile() for m in runner.modes}
for rnd in range(args.rounds):
    for m in runner.modes:
        sync()
        prof = profs[m] if args.profile else None
        if prof:
            prof.enable()
        r = runner.run(m, prompts, args.tokens)
        if prof:
            prof.disable()
        n = args.batch * (args.tokens - 1)
        print(f"{args.size} b{args.batch} round {rnd} {m:20s} prefill {1e3 * r.prefill_s:8.2f} ms  "
              f"decode {1e3 * r.decode_s:8.2f} ms ({n / r.decode_s:7.1f} tok/s)", flush=True)
for m in runner.modes if args.profile else ():
    print(f"== {m}: {args.rounds} timed runs, by own time")
    pstats.Stats(profs[m]).sort_stats("tottime").print_stats(args.profile)
