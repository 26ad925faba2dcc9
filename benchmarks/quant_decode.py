"""Quantized drop-in caches at long context: decode tokens/s and KV memory of the drop-in cache in
bf16 (or the model's dtype) against the same cache quantized to 8 and 4 bits (mlx-lm's QuantizedKVCache
format, registry/integrations/mlx_lm_quant_cache.py), one model, B rows of `context` tokens.

The caches are filled directly (random keys and values, quantized with mx.quantize for the quantized
ones, offset = context) rather than by a prefill of B x context tokens, so a cell costs seconds: the
decode steps then run the model's own forward (the drop-in direct forward: one fused write and one
attention per layer, at B rows of `context` valid keys), greedy, as mlx-lm's loop would. mlx-lm's own
QuantizedKVCache is not a mode: on CUDA its attention fails (MLX 0.32.4's quantized_matmul has no
kernel for these shapes) and its BatchGenerator batches no quantized cache.

    python -m benchmarks.quant_decode --size llama-8b --batch 4 --context 32768 --steps 32
prints per mode: tokens/s (B x steps / seconds of the timed steps, median of rounds), KV bytes
(every layer's buffers), and the ratio to the first mode; the targets of issue 35 are 8-bit >= 1.2x
and 4-bit >= 1.4x the bf16 drop-in's tokens/s, KV memory within 10% of bits/16 of bf16's plus the
scales and biases (reported as `ideal`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

MODES = {"bf16": None, "q8": 8, "q4": 4}


def fill(cache: list, batch: int, context: int, room: int, dims: tuple, seed: int = 0) -> None:
    """Every KVCache / QuantizedKVCache of `cache` holds `context` random rows per batch row (buffers of
    context + room rows, a multiple of 256 as mlx-lm grows them); dims = (n_kv_heads, head_dim, dtype).
    Other caches (rotating windows) are left to fill themselves."""
    H, D, dtype = dims
    key = mx.random.key(seed)
    rows = -(-(context + room) // 256) * 256
    for c in cache:
        if type(c).__name__ not in ("KVCache", "QuantizedKVCache"):
            continue
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((batch, H, rows, D), key=k1).astype(dtype)
        v = mx.random.normal((batch, H, rows, D), key=k2).astype(dtype)
        if hasattr(c, "bits"):
            c.keys = tuple(mx.quantize(k, group_size=c.group_size, bits=c.bits))
            c.values = tuple(mx.quantize(v, group_size=c.group_size, bits=c.bits))
        else:
            c.keys, c.values = k, v
        c.offset = context
        mx.eval(c.keys, c.values)


def kv_bytes(cache: list) -> int:
    total = 0
    for c in cache:
        for side in (getattr(c, "keys", None), getattr(c, "values", None)):
            for a in (side if isinstance(side, tuple) else (side,)):
                total += a.nbytes if isinstance(a, mx.array) else 0
    return total


def run_mode(model, bits, group_size: int, batch: int, context: int, steps: int, rounds: int, dims) -> dict:
    from registry.integrations.mlx_lm import make_prompt_cache

    cache = make_prompt_cache(model) if bits is None else make_prompt_cache(model, kv_bits=bits,
                                                                            kv_group_size=group_size)
    fill(cache, batch, context, steps * (rounds + 1) + 8, dims)
    tok = mx.zeros((batch, 1), dtype=mx.int32)

    def step(t):
        logits = model(t, cache=cache)
        return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True).astype(mx.int32)

    def steps_of(n, y):
        """mlx-lm's loop: the next step built while this one runs, then this one waited for (one step
        in flight, so a write never meets an earlier step's pending read of the buffers)."""
        for _ in range(n):
            nxt = step(y)
            mx.async_eval(nxt)
            mx.eval(y)
            y = nxt
        mx.eval(y)
        return y

    from registry import native

    tok = steps_of(3, tok)                        # warm-up: plans, pipelines, graphs
    native.reset_stats()
    times = []
    for _ in range(rounds):
        mx.synchronize()
        t0 = time.perf_counter()
        tok = steps_of(steps, tok)
        times.append(time.perf_counter() - t0)
    st = native.stats()
    return dict(tokens_per_s=batch * steps / statistics.median(times), kv_bytes=kv_bytes(cache),
                copies=st["copies"], syncs=st["syncs"],
                implementation=next((c.reason for c in cache if hasattr(c, "reason")), ""))


def main(argv=None) -> None:
    from .e2e import SIZES, random_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_decode", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="llama-8b", choices=sorted(SIZES))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes: expected a comma list of {', '.join(MODES)}, got {a.modes!r}")
    if min(a.batch, a.context, a.steps, a.rounds) < 1:
        p.error("--batch, --context, --steps and --rounds must be >= 1")
    cfg = SIZES[a.size].config
    cfg = cfg.get("text_config", cfg)
    H = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = getattr(mx, a.dtype)
    model = random_model(SIZES[a.size].config, dtype)
    results = {}
    for m in modes:
        r = run_mode(model, MODES[m], a.group_size, a.batch, a.context, a.steps, a.rounds, (H, D, dtype))
        results[m] = r
        mx.clear_cache()
    base = results[modes[0]]          # the ratios are to the first mode (bf16 by default)
    itemsize = mx.zeros((), dtype).itemsize
    for m, r in results.items():
        bits = MODES[m]
        # words: bits / 8 bytes per feature; scales and biases: 2 values of `itemsize` per group
        ideal = 1.0 if bits is None else (bits / 8 + 2 * itemsize / a.group_size) / itemsize
        print(f"{a.size} B={a.batch} context={a.context} {m:>4}: {r['tokens_per_s']:9.1f} tokens/s "
              f"({r['tokens_per_s'] / base['tokens_per_s']:.2f}x {modes[0]})  KV {r['kv_bytes'] / 2**30:7.2f} GiB "
              f"({r['kv_bytes'] / base['kv_bytes']:.3f}x; {ideal:.3f}x ideal vs bf16)  pool copies {r['copies']}, "
              f"syncs {r['syncs']}  [{r['implementation'][:100]}]",
              flush=True)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(dict(vars(a), results=results), f, indent=1)


if __name__ == "__main__":
    main()
