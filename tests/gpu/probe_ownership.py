"""Probe (not a test): owner counts of a pool when the next call is built, after mx.eval and under
mx.async_eval pipelining, and whether the pool stayed in place. Run on the GPU host after
tests/gpu/run_on_host.sh: `PYTHONPATH=. python3 tests/gpu/probe_ownership.py` (docs/gpu-runs.md).

Each entry is (array objects and pending ops referring to the pool, owners of its buffer): the first
is what the in-place policy counts and must not vary; the second includes MLX's in-flight work and
varies with timing (-1: not computed yet)."""
import mlx.core as mx
import numpy as np

from registry import native
from registry.rope import RopeConfig
from tests.test_native_rope_pool_fused import native_kernel

ext = native.import_ext()
kernel = native_kernel(RopeConfig(128))
T, S = 8, 4096
q, k, v = (mx.random.normal(s).astype(mx.bfloat16) for s in ((T, 32, 128), (T, 8, 128), (T, 8, 128)))
kp, vp = mx.zeros((S, 8, 128), mx.bfloat16), mx.zeros((S, 8, 128), mx.bfloat16)
pos = mx.arange(T, dtype=mx.int32)
mx.eval(q, k, v, kp, vp, pos)
ptr = lambda a: np.asarray(a.view(mx.uint16)).__array_interface__["data"][0]
p0 = ptr(kp)
for mode in ("eval", "async_eval"):
    native.reset_stats()
    seen = []
    for i in range(6):
        seen.append(ext.owner_counts(kp))
        slots = mx.arange(T, dtype=mx.int32) + i * T
        _, _, kp, vp = kernel(q, k, v, pos, slots, kp, vp, check_slots=False)
        y = mx.sum(kp[: (i + 1) * T].astype(mx.float32))
        (mx.eval if mode == "eval" else mx.async_eval)(y)
    mx.eval(kp)
    print(mode, "owners before each call:", seen, "same buffer at the end:", ptr(kp) == p0, native.stats())
