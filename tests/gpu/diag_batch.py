"""Probe (not a test): mlx-lm's BatchGenerator with stock caches and with the drop-in fused cache
(registry.integrations.mlx_lm.make_prompt_cache), in interleaved rounds: decode and prefill time per
run, and the native launcher's counters per run (copies, syncs and first-use checks must stay 0: a
sync is a host wait that drains the GPU's queue; output mallocs and frees are the CUDA free list's
misses and evictions). Sizes from benchmarks/e2e.SIZES (random bf16
weights). docs/benchmarks/e2e-root-cause.md, "Nothing waits for the GPU".

    PYTHONPATH=. python3 tests/gpu/diag_batch.py [--size llama-8b[,llama-1b...]] [--batch 32[,8...]] [--prompt 128] [--tokens 64] [--rounds 4]
"""
import argparse

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

from mlx_lm.models.cache import make_prompt_cache as stock   # noqa: E402  (after the argument checks)

caches = {"stock": stock, "dropin": make_prompt_cache}
for size in sizes:                  # the cells in order, as bench --e2e runs them: earlier ones leave state
    config = SIZES[size].config
    model = random_model(config, mx.bfloat16)
    for batch in args.batch:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, config["vocab_size"], args.prompt).tolist() for _ in range(batch)]
        for make in caches.values():                                     # untimed: compile and allocate
            _mlx_lm_batch(model, prompts, 4, [make(model) for _ in prompts])
        print(f"# {mx.default_device()}, mlx {mx.__version__}: {size} bf16, batch {batch}, {args.prompt}-token "
              f"prompts, {args.tokens} tokens; BatchGenerator per cache, interleaved rounds")
        for r in range(args.rounds):
            for name, make in caches.items():
                per_request = [make(model) for _ in prompts]
                native.reset_stats()
                run = _mlx_lm_batch(model, prompts, args.tokens, per_request)
                st = native.stats()
                print(f"round {r} {name:7s} decode {run.decode_s:.3f} s  prefill {run.prefill_s:.3f} s  launches "
                      f"{st['launches']} copies {st['copies']} syncs {st['syncs']} first-use checks "
                      f"{st['first_use_checks']} output mallocs {st['output_mallocs']} frees {st['output_frees']}",
                      flush=True)
    del model
