"""The slot engine's pool reads and writes in MLX's own ops, slot-major `[S, H, D]` (the engine's
pools) against head-major `[1, H, S, D]` (mlx-lm's cache layout), on the current device: a batch's
gather of its context slots, a lone request's run read as a view, and a decode step's write of one
row per request. Why the engine's pools stay slot-major: docs/benchmarks/e2e-root-cause.md, "The slot engine".

    python -m benchmarks.pool_layout [--shapes 32x192x8x128,8x192x8x64] [--layers 32]

A shape is batch x context x kv heads x head_dim; the pool holds batch * context slots. Each op runs
on `--layers` pools per evaluation (one decode step's layers) and is reduced to a scalar, so that an
evaluation never keeps the gathered arrays; microseconds per op, the best of 2 medians of 10.
"""
from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from .cases import layer_count, memory_budget


def _time(build, reps: int = 10) -> float:
    """Median seconds of one evaluation of build()'s arrays."""
    for _ in range(3):
        mx.eval(build())
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(build())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ops(B: int, ctx: int, H: int, D: int, layers: int, dtype=mx.bfloat16) -> dict:
    """name -> a builder of one evaluation (`layers` ops); the pools, tables and rows, evaluated."""
    S = B * ctx
    slot_major = [mx.random.normal((S, H, D)).astype(dtype) for _ in range(layers)]
    head_major = [mx.contiguous(p.transpose(1, 0, 2)[None]) for p in slot_major]     # the same rows
    table = mx.random.randint(0, S, (B, ctx)).astype(mx.int32)
    along = mx.broadcast_to(table.reshape(1, 1, -1, 1), (1, H, B * ctx, D))
    slots = mx.random.permutation(S)[:B].astype(mx.int32)
    slots_along = mx.broadcast_to(slots.reshape(1, 1, -1, 1), (1, H, B, D))
    x = mx.random.normal((B, H, 1, D)).astype(dtype)          # one new row per request, as attention has it
    mx.eval(slot_major, head_major, table, along, slots, slots_along, x)

    def write_slot_major():
        for p in slot_major:
            p[slots] = x.transpose(0, 2, 1, 3).reshape(B, H, D)
        return slot_major

    def write_head_major():
        for p in head_major:
            p[:, :, slots] = x.transpose(2, 1, 0, 3)
        return head_major

    return {
        "gather: slot-major pool[table]": lambda: [p[table].transpose(0, 2, 1, 3).sum() for p in slot_major],
        "gather: head-major take(axis=2)": lambda: [mx.take(p, table, axis=2).squeeze(0).transpose(1, 0, 2, 3).sum()
                                                    for p in head_major],
        "gather: head-major take_along_axis": lambda: [
            mx.take_along_axis(p, along, axis=2).reshape(H, B, ctx, D).transpose(1, 0, 2, 3).sum() for p in head_major],
        "run: slot-major as_strided view": lambda: [
            mx.as_strided(p, (1, H, ctx, D), (S * H * D, D, H * D, 1), 0).sum() for p in slot_major],
        "run: head-major slice": lambda: [p[:, :, :ctx].sum() for p in head_major],
        "write: slot-major pool[slots] =": write_slot_major,
        "write: head-major pool[:, :, slots] =": write_head_major,
        "write: head-major put_along_axis": lambda: [
            mx.put_along_axis(p, slots_along, x.transpose(1, 0, 2, 3).reshape(1, H, B, D), axis=2) for p in head_major],
    }


def _shape(text: str) -> tuple[int, int, int, int]:
    try:
        B, ctx, H, D = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch x context x kv heads x head_dim, "
                                         f"e.g. 32x192x8x128") from None
    if min(B, ctx, H, D) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be positive")
    return B, ctx, H, D


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pool_layout")
    p.add_argument("--shapes", type=lambda s: [_shape(t) for t in s.split(",")],
                   default=[(32, 192, 8, 128), (8, 192, 8, 64)], help="e.g. 32x192x8x128,8x192x8x64")
    p.add_argument("--layers", type=layer_count, default=32, help="ops per evaluation, 1-256 (default 32)")
    args = p.parse_args(argv)
    budget = memory_budget()
    for B, ctx, H, D in args.shapes:
        elements = B * ctx * H * D
        need = 2 * args.layers * elements * 2            # both layouts' pools, bf16
        if elements > 2**31 - 1:
            p.error(f"argument --shapes: {B}x{ctx}x{H}x{D}: a pool of {B * ctx} slots is {elements} elements; "
                    f"MLX's ops take at most 2^31 - 1")
        if need > budget:
            p.error(f"argument --shapes/--layers: {B}x{ctx}x{H}x{D} with --layers {args.layers} needs "
                    f"{need / 2**30:.1f} GiB of pools; at most half of this machine's memory "
                    f"({budget / 2**30:.1f} GiB): use a smaller shape or fewer --layers")
    print(f"# {mx.default_device()}, mlx {mx.__version__}: us per op, {args.layers} ops per evaluation, bfloat16")
    for B, ctx, H, D in args.shapes:
        for name, build in ops(B, ctx, H, D, args.layers).items():
            us = min(_time(build), _time(build)) / args.layers * 1e6
            print(f"B={B:<3d} ctx={ctx:<5d} H={H:<3d} D={D:<4d} {name:40s} {us:9.1f}", flush=True)


if __name__ == "__main__":
    main()
