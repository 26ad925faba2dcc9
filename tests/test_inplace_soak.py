"""Soak: a 32-layer decode loop of 1000 steps, with an attention-like reader that slices every pool
as mlx-lm's attention does, under mx.eval and under mx.async_eval pipelining. The pools must never
be copied (registry.native.stats()) and active memory must stay flat. Runs on the default device:
the CPU in CI, the GPU on the GPU host (tests/gpu/run_on_host.sh)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from registry import native
from registry.rope import RopeConfig
from tests.test_native_rope_pool_fused import data_ptr, native_kernel

LAYERS, STEPS, POOL = 32, 1000, 1024


@pytest.mark.parametrize("evaluate", ["eval", "async_eval"])
def test_decode_soak_never_copies_a_pool(native_artifacts, evaluate):
    kernel = native_kernel(RopeConfig(64))
    run = mx.eval if evaluate == "eval" else mx.async_eval
    q, k, v = (mx.random.normal(s).astype(mx.bfloat16) for s in ((1, 4, 64), (1, 2, 64), (1, 2, 64)))
    pools = [[mx.zeros((POOL, 2, 64), mx.bfloat16), mx.zeros((POOL, 2, 64), mx.bfloat16)] for _ in range(LAYERS)]
    mx.eval(q, k, v, pools)
    first = [data_ptr(p) for pair in pools for p in pair]
    baseline = None
    for step in range(STEPS):
        if step == 8:                                   # steady state from here on
            mx.synchronize()
            gc.collect()                                # earlier tests' garbage is not the soak's
            baseline, stats = mx.get_active_memory(), native.stats()
        slot = step % POOL
        pos = mx.array([step], dtype=mx.int32)
        slots = mx.array([slot], dtype=mx.int32)
        h = q
        for layer in range(LAYERS):
            kp, vp = pools[layer]
            h, _, kp, vp = kernel(h, k, v, pos, slots, kp, vp, check_slots=False)
            pools[layer] = [kp, vp]
            # attention-like: read the pool through a slice, not through the kernel's outputs
            ctx = mx.sum(kp[: slot + 1].astype(mx.float32)) + mx.sum(vp[: slot + 1].astype(mx.float32))
            h = h + (ctx * 0).astype(h.dtype)
        run(h)
    mx.synchronize()
    gc.collect()
    after = native.stats()
    assert after["copies"] == stats["copies"], "a pool was copied in steady state"
    assert after["aliased"] - stats["aliased"] == 2 * LAYERS * (STEPS - 8)
    # Flat: a leak of one pool (256 KiB) or of a few bytes per step (x 992 steps) would show; MLX's
    # own one-off small allocations (seen: up to 192 bytes either way) do not.
    growth = mx.get_active_memory() - baseline
    assert growth < 1024, f"active memory grew by {growth} bytes during the soak"
    assert [data_ptr(p) for pair in pools for p in pair] == first
