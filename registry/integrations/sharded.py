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

On GPUs, one rank per GPU over NCCL: `mlx.launch --backend nccl -n 2 -- python -m
registry.integrations.sharded --backend nccl --device gpu --dtype bfloat16`. Bad setups end with exit
status 2 and one line naming what is wrong, before any collective could wait forever: a backend
this MLX cannot start (`mx.distributed.is_available`, then `init(strict=True)`), a world size of 1
when a backend was named (the launcher did not start the ranks), `--device gpu` on a rank that has
no GPU, and a world size that does not divide a layer's query or KV heads (mlx-lm's shard() would
split them unevenly).
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
    p.add_argument("--backend", default="any", choices=("any", "ring", "mpi", "nccl", "jaccl"),
                   help="mx.distributed backend (any: the first that starts)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"),
                   help="where each rank runs (auto: MLX's default device)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
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
    group, why = _group(args.backend)
    if group is None:
        print(f"error: --backend {args.backend}: {why}", file=sys.stderr)
        return 2
    why = _use_device(args.device, group)
    if why:
        print(f"error: rank {group.rank()}: --device {args.device}: {why}", file=sys.stderr)
        return 2
    mx.random.seed(0)
    model = build_model(ARCHS[names[args.model]], dtype=getattr(mx, args.dtype))
    if not hasattr(model, "shard"):
        print(f"error: mlx-lm's {type(model).__module__} has no shard()", file=sys.stderr)
        return 2
    why = heads_problem(model, group.size())
    if why:
        print(f"error: world size {group.size()}: {why}", file=sys.stderr)
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


def _group(backend: str):
    """(the global group, "") or (None, why it cannot be had)."""
    if not mx.distributed.is_available(backend):
        return None, f"this MLX build cannot start it (mx.distributed.is_available({backend!r}) is False)"
    try:
        group = mx.distributed.init(strict=backend != "any", backend=backend)
    except RuntimeError as e:
        return None, (f"mx.distributed.init failed: {str(e).strip()} (start the ranks with mlx.launch, e.g. "
                      f"mlx.launch --backend {backend} -n 2 -- python -m registry.integrations.sharded ...)")
    if backend != "any" and group.size() < 2:
        return None, "a world of 1 rank: start the ranks with mlx.launch (e.g. mlx.launch --backend nccl -n 2 -- ...)"
    return group, ""


def _use_device(device: str, group) -> str:
    """Make `device` the default for this rank; "" or why it cannot."""
    if device == "auto":
        return ""
    if device == "cpu":
        mx.set_default_device(mx.cpu)
        return ""
    if not (mx.cuda.is_available() or mx.metal.is_available()) or mx.device_count(mx.gpu) < 1:
        return "this rank sees no GPU (MLX has no GPU backend or no device here)"
    mx.set_default_device(mx.gpu)
    return ""


def heads_problem(model, size: int) -> str:
    """"" when `size` ranks divide every attention layer's query and KV heads, else which layer and
    heads do not divide (mlx-lm's shard() splits heads evenly across the group)."""
    from registry.integrations.mlx_lm import find_attention_layers

    for i, attn in find_attention_layers(model)[0].items():
        for name in ("n_heads", "n_kv_heads"):
            n = getattr(attn, name, None)
            if isinstance(n, int) and n % size:
                return f"layer {i} has {name}={n}, which {size} ranks cannot split evenly"
    return ""


if __name__ == "__main__":
    sys.exit(main())
