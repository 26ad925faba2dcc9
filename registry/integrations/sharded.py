"""The fused caches on a model sharded with mlx-lm's own tensor parallelism (`model.shard(group)`
over mx.distributed). Run one process per rank with MLX's launcher, e.g. 2 processes on loopback
with the ring backend on the CPU:

    mlx.launch --backend ring -n 2 -- python -m registry.integrations.sharded --model llama --max-tokens 8

(`-m`: run as a script, this directory's mlx_lm.py would shadow the mlx_lm package.)

Every rank builds the same random-weight model (same seed), decodes greedily with the unsharded
model (mlx-lm's own caches) for the reference, shards it, makes its fused caches (the trace reads
the sharded head counts off the arrays, so each rank gets its own kernel sets), decodes again and
prints one JSON line: rank, world size, per-rank heads of each fused layer configuration, whether
the tokens (sampled with a fixed seed) match the unsharded model's, and the largest log-prob
difference (at most 1e-4 required). Exit status 1 on a
mismatch. `--model` takes the architectures of docs/coverage.md whose mlx-lm module implements
`shard` (llama, qwen2, qwen3, ministral3, ...).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import mlx.core as mx
import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", help="architecture name (docs/coverage.md) with mlx-lm's shard()")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompt", default="3,17,42,99,7,11", help="comma-separated token ids")
    args = p.parse_args(argv)

    from registry.integrations.coverage import ARCHS
    from registry.integrations.generate import _arch_names
    from registry.integrations.mlx_lm import build_model, import_mlx_lm_module
    from registry.integrations.mlx_lm_cache import fused_model, make_prompt_cache

    names = _arch_names()
    if args.model not in names:
        print(f"error: --model {args.model!r}: not an architecture name", file=sys.stderr)
        return 2
    try:
        prompt = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        print(f"error: --prompt {args.prompt!r}: expected comma-separated token ids", file=sys.stderr)
        return 2
    group = mx.distributed.init()
    mx.random.seed(0)
    model = build_model(ARCHS[names[args.model]], dtype=mx.float32)
    if not hasattr(model, "shard"):
        print(f"error: mlx-lm's {type(model).__module__} has no shard()", file=sys.stderr)
        return 2
    stock = import_mlx_lm_module("cache")

    gen = importlib.import_module("mlx_lm.generate")

    def decode(cache):
        # Sampled with a fixed seed, the same on every rank and run: greedy tokens of a tiny
        # random-weight model tend to repeat one token, which would make the comparison weak.
        mx.random.seed(1)
        toks, lps = [], []
        for (t, lp), _ in zip(gen.generate_step(mx.array(prompt), model, max_tokens=args.max_tokens,
                                                prompt_cache=cache, sampler=mx.random.categorical),
                              range(args.max_tokens)):
            toks.append(int(t))
            lps.append(np.array(lp))
        return toks, np.stack(lps)

    want = decode(stock.make_prompt_cache(model))
    model.shard(group)
    cache = make_prompt_cache(model)
    fm = fused_model(model)
    got = decode(cache)
    heads = sorted({(c.n_heads, c.n_kv_heads) for i, c in fm.kernels.config_of.items() if i in fm.fusions})
    same = got[0] == want[0]
    diff = float(np.abs(got[1] - want[1]).max())
    print(json.dumps({"rank": group.rank(), "size": group.size(), "fused_layers": sorted(fm.fusions),
                      "heads_per_rank": heads, "implementation": sorted({f.kernel.implementation
                                                                         for f in fm.fusions.values()}),
                      "tokens": got[0], "same_tokens": same, "max_logprob_diff": diff}), flush=True)
    return 0 if same and diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
