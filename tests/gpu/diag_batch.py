"""Probe (not a test): mlx-lm's BatchGenerator with stock caches and with the drop-in fused cache
(registry.integrations.mlx_lm.make_prompt_cache), in interleaved rounds: decode and prefill time per
run, and the native launcher's counters per run (copies, syncs and first-use checks must stay 0: a
sync is a host wait that drains the GPU's queue; output mallocs and frees are the CUDA free list's
misses and evictions). Sizes from benchmarks/e2e.SIZES (random bf16
weights). docs/benchmarks/e2e-root-cause.md, "Nothing waits for the GPU".

    PYTHONPATH=. python3 tests/gpu/diag_batch.py [--size llama-8b[,llama-1b...]] [--batch 32[,8...]] [--prompt 128] [--tokens 64] [--rounds 4] [--stagger]

--stagger: request i gets a prompt i tokens shorter and finishes i * tokens / batch steps later, so
the longest prompt finishes first and every finish shifts the batch caches left (mlx-lm's filter
slices off the padding all others share); copies and syncs must stay 0 there too.
"""
import argparse
import time

import mlx.core as mx
import numpy as np

from benchmarks.e2e import SIZES, _mlx_lm_batch, random_model
from registry import native
from registry.integrations.mlx_lm import make_prompt_cache

def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas") from None


p = argparse.ArgumentParser()
p.add_argument("--size", default="llama-8b",
               help="a size of benchmarks/e2e.SIZES, or several separated by commas: run in one process, in order")
p.add_argument("--batch", type=int_list, default=[32], help="a batch size, or several separated by commas")
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--rounds", type=int, default=4)
p.add_argument("--stagger", action="store_true", help="prompts of different lengths, finishing longest first")
args = p.parse_args()
sizes = args.size.split(",")
for s in sizes:
    if s not in SIZES:
        p.error(f"argument --size: {s!r}: expected one of {', '.join(sorted(SIZES))}")
for name, values in (("batch", args.batch), ("prompt", [args.prompt]), ("tokens", [args.tokens]),
                     ("rounds", [args.rounds])):
    least = 2 if name == "batch" else 1
    for v in values:
        if v < least:
            p.error(f"argument --{name}: {v}: expected at least {least}")

if args.stagger and args.prompt <= max(args.batch):
    p.error(f"argument --prompt: {args.prompt}: with --stagger, expected more than the largest --batch "
            f"({max(args.batch)}): request i's prompt is i tokens shorter")

from mlx_lm.models.cache import make_prompt_cache as stock   # noqa: E402  (after the argument checks)

caches = {"stock": stock, "dropin": make_prompt_cache}


def staggered(model, prompts, n, per_request):
    """_mlx_lm_batch with request i's prompt i tokens shorter, finishing longest prompt first."""
    from benchmarks.e2e import Run, sync
    from mlx_lm.generate import BatchGenerator
    B = len(prompts)
    max_tokens = [max(1, n * (i + 1) // B) for i in range(B)]
    gen = BatchGenerator(model, stop_tokens=[], max_tokens=n, completion_batch_size=B, prefill_batch_size=B)
    try:
        uids = gen.insert([q[:len(q) - i] for i, q in enumerate(prompts)], max_tokens, caches=per_request)
        got = {u: [] for u in uids}
        t0, t1 = time.perf_counter(), None
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append(r.token)
            t1 = t1 or time.perf_counter()
        sync()
    finally:
        gen.close()
    return Run([got[u] for u in uids], t1 - t0, time.perf_counter() - t1)


run_batch = staggered if args.stagger else _mlx_lm_batch
for size in sizes:                  # the cells in order, as bench --e2e runs them: earlier ones leave state
    config = SIZES[size].config
    model = random_model(config, mx.bfloat16)
    for batch in args.batch:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, config["vocab_size"], args.prompt).tolist() for _ in range(batch)]
        for make in caches.values():                                     # untimed: compile and allocate
            run_batch(model, prompts, 4, [make(model) for _ in prompts])
        print(f"# {mx.default_device()}, mlx {mx.__version__}: {size} bf16, batch {batch}, {args.prompt}-token "
              f"prompts, {args.tokens} tokens; BatchGenerator per cache, interleaved rounds")
        for r in range(args.rounds):
            for name, make in caches.items():
                per_request = [make(model) for _ in prompts]
                native.reset_stats()
                run = run_batch(model, prompts, args.tokens, per_request)
                st = native.stats()
                print(f"round {r} {name:7s} decode {run.decode_s:.3f} s  prefill {run.prefill_s:.3f} s  launches "
                      f"{st['launches']} copies {st['copies']} syncs {st['syncs']} first-use checks "
                      f"{st['first_use_checks']} output mallocs {st['output_mallocs']} frees {st['output_frees']}",
                      flush=True)
    del model
