"""Probe (not a test): the fp32 RoPE cos/sin each path computes on the current device, against
float64 of the same fp32 angles: the native rope_pool_fused kernel (q rows of unit vectors, so its
output pairs are (cos, sin)), MLX's mx.cos/mx.sin inside the reference path's graph, and standalone.
Then the growth test's scenario (tests/test_mlx_lm_cache.py): per layer, the largest difference of
the fused cache's key rows from the same cache on the reference path, and from which position on.
Tells a trig error of one path from differences that grow through the layers.

    PYTHONPATH=. python3 tests/gpu/diag_trig.py
"""
import mlx.core as mx
import numpy as np

from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_kernel_sets, build_model, make_prompt_cache
from registry.kernels._rope import inv_freq, rotate
from tests.test_mlx_lm_cache import NEW, fresh_model, run

model = fresh_model("llama")
kernels = build_kernel_sets(model)
kernel = next(k.rope for k in kernels.by_layer.values() if k.rope is not None)
rope = kernel.rope
print(f"kernel {kernel!r}: {kernel.reason}")
T, D, R = 1024, 16, rope.rotary_dims
half = R // 2
positions = mx.arange(T, dtype=mx.int32)
q = mx.zeros((T, 1, D), mx.float32)
q[:, :, :half] = 1.0                       # x1 = 1, x2 = 0: out = (cos, sin) per pair
k = mx.array(q)
pools = mx.zeros((1, 1, D), mx.float32), mx.zeros((1, 1, D), mx.float32)
slots = mx.full((T,), -1, dtype=mx.int32)
q_out = kernel(q, k, q, positions, slots, *pools, check_slots=False)[0]
ref = rotate(q, positions, rope)
angles = np.array(positions.astype(mx.float32))[:, None] * np.float32(rope.pos_scale) * np.array(inv_freq(rope))[None]
a64 = angles.astype(np.float64)
want = np.concatenate([np.cos(a64), np.sin(a64)], axis=-1)
for label, got in (("kernel", q_out), ("reference path", ref)):
    err = np.abs(np.array(got)[:, 0, :R].astype(np.float64) - want)
    worst = np.unravel_index(err.argmax(), err.shape)
    print(f"{label:15s} max |(cos, sin) - float64| {err.max():.3g} at position {worst[0]} pair {worst[1] % half} "
          f"(angle {a64[worst[0], worst[1] % half]:.1f} rad); positions with error > 1e-6: "
          f"{int((err.max(axis=1) > 1e-6).sum())}", flush=True)
ang = mx.array(angles)
for name, f, g in (("mx.cos", mx.cos, np.cos), ("mx.sin", mx.sin, np.sin)):
    print(f"standalone {name} max error {np.abs(np.array(f(ang)).astype(np.float64) - g(a64)).max():.3g}")

prompt = (np.arange(300) * 7 % 250).tolist()
cache = make_prompt_cache(model)
run(model, cache, prompt, prefill_step_size=128)
twin = fresh_model("llama")
import os
os.environ["MLX_AOT_DISABLE_NATIVE"] = "1"
ref_kernels = build_kernel_sets(twin)
del os.environ["MLX_AOT_DISABLE_NATIVE"]
exact = make_prompt_cache(twin, kernels=ref_kernels)
run(twin, exact, prompt, prefill_step_size=128)
for layer, (ours, same) in enumerate(zip(cache, exact)):
    n = ours.offset
    a, b = np.array(ours.keys[..., :n, :]), np.array(same.keys[..., :n, :])
    d = np.abs(a - b).max(axis=(0, 1, 3))
    first = int(np.argmax(d > 1e-5)) if (d > 1e-5).any() else None
    print(f"layer {layer}: keys max diff {d.max():.3g} at position {int(d.argmax())}, first position > 1e-5: {first}; "
          f"values max diff {np.abs(np.array(ours.values[..., :n, :]) - np.array(same.values[..., :n, :])).max():.3g}; "
          f"|keys| max {np.abs(b).max():.3g}", flush=True)
