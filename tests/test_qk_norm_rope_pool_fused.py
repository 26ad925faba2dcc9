"""qk_norm_rope_pool_fused: the native kernel of the default device (CPU in CI, the GPU on the GPU
host) and the reference against a NumPy oracle over every RoPE variant, both norm forms (w, 1 + w),
both pool layouts; the reference against mlx-lm's own modules; norm probing; the slot and
position checks; argument errors."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from registry import KernelRegistry
from registry.core import backend_of, describe_qk_norm
from registry.errors import KernelArgumentError
from registry.kernels.qk_norm_rope_pool_fused import (QkNormRopePoolFusedKernel, qk_norm_rope_pool_fused,
                                                      qk_norm_rope_pool_fused_reference)
from registry.norm import NormConfig, UnsupportedNorm, normalize_qk_norm
from registry.rope import RopeConfig
from tests._oracle import rotate_numpy
from tests.rope_cases import MX_DTYPES, TOL, VARIANTS, rope_variant, to_np
from tests.test_kv_pool_store import store_numpy

SPEC = KernelRegistry.from_yaml().manifest.kernel("qk_norm_rope_pool_fused")
INT32_MAX = 2**31 - 1


def native_kernel(rope, norm) -> QkNormRopePoolFusedKernel:
    backend = backend_of(None)
    kernel = QkNormRopePoolFusedKernel.build(SPEC, QkNormRopePoolFusedKernel.context_for((rope, norm), backend))
    assert kernel.implementation == f"native-{backend}", kernel.reason
    return kernel


def make(T, Hq, Hkv, D, pool_shape, dtype, slots, pool_dtype=None, seed=0):
    rng = np.random.default_rng(seed)
    arr = lambda shape, dt=dtype, s=1.0: mx.array((rng.standard_normal(shape) * s).astype(np.float32)).astype(MX_DTYPES[dt])
    pd = pool_dtype or dtype
    return (arr((T, Hq, D), s=3.0), arr((T, Hkv, D), s=0.5), arr((T, Hkv, D)),
            mx.array(rng.integers(0, 5000, T).astype(np.int32)), mx.array(np.asarray(slots, np.int32)),
            arr(pool_shape, pd), arr(pool_shape, pd), arr((D,), s=0.5), arr((D,), s=0.5))


def oracle(args, rope, norm):
    """Float64 norm, one rounding to the activations' dtype (as the model's norm returns it), float64 RoPE."""
    q, k, v, pos, slots, kp, vp, wq, wk = args

    def normed(x, w):
        x64 = to_np(x).astype(np.float64)
        y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + norm.eps) * (to_np(w) + norm.weight_offset)
        return to_np(mx.array(y.astype(np.float32)).astype(x.dtype))

    p = to_np(pos)
    q_out, k_out = rotate_numpy(normed(q, wq), p, rope), rotate_numpy(normed(k, wk), p, rope)
    s = to_np(slots)
    k_rounded = to_np(mx.array(k_out.astype(np.float32)).astype(kp.dtype))
    return q_out, k_out, store_numpy(to_np(kp), s, k_rounded), store_numpy(to_np(vp), s, to_np(v.astype(vp.dtype)))


def check(got, args, rope, norm, dtype):
    want = oracle(args, rope, norm)
    tol = TOL[dtype] * 2    # the norm's rounding to T before the rotation, on values of |x| <~ 4
    for name, g, w, like in zip(("q_out", "k_out", "k_pool", "v_pool"), got, want, (args[0], args[1], args[5], args[6])):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        np.testing.assert_allclose(to_np(g), w, atol=tol, rtol=tol, err_msg=name)


LAYOUTS = {"slot-major": lambda S, H, D: (S, H, D), "head-major": lambda S, H, D: (2, H, S // 2, D)}
NORMS = [NormConfig(1e-6, 0.0), NormConfig(1e-5, 1.0)]


def cases():
    out = []
    for n, (dtype, variant) in enumerate(itertools.product(MX_DTYPES, VARIANTS)):
        out.append((dtype, variant, (64, 128, 96)[n % 3], NORMS[n % 2], list(LAYOUTS)[(n // 2) % 2], (1, 4, 8)[n % 3]))
    return out


@pytest.mark.parametrize("dtype, variant, head_dim, norm, layout, gqa", cases())
def test_native_and_reference_match_the_oracle(native_artifacts, dtype, variant, head_dim, norm, layout, gqa):
    rope = rope_variant(variant, head_dim)
    slots = [5, -1, 0, 11, -1, 3, 7]
    hkv = 2
    args = make(len(slots), hkv * gqa, hkv, head_dim, LAYOUTS[layout](12, hkv, head_dim), dtype, slots, seed=head_dim)
    check(qk_norm_rope_pool_fused_reference(*args, rope=rope, norm=norm), args, rope, norm, dtype)
    got = native_kernel(rope, norm)(*args[:5], mx.array(args[5]), mx.array(args[6]), *args[7:])
    check(got, args, rope, norm, dtype)
    ref = qk_norm_rope_pool_fused_reference(*args, rope=rope, norm=norm)
    for name, g, r in zip(("q_out", "k_out", "k_pool", "v_pool"), got, ref):   # native vs reference
        np.testing.assert_allclose(to_np(g), to_np(r), atol=TOL[dtype], rtol=TOL[dtype], err_msg=name)


def test_head_dim_512_and_unchecked_out_of_range_slots(native_artifacts):
    rope, norm = RopeConfig(256, base=1e6), NormConfig(1e-6, 1.0)
    slots = [2, INT32_MAX, -3, 4, 0]
    args = make(5, 4, 1, 512, (4, 1, 512), "bfloat16", slots)
    check(native_kernel(rope, norm)(*args, check_slots=False), args, rope, norm, "bfloat16")


@pytest.mark.parametrize("act, pool", [(a, p) for a in MX_DTYPES for p in MX_DTYPES if a != p])
def test_mixed_dtypes_convert_on_the_store(native_artifacts, act, pool):
    rope, norm = RopeConfig(64), NormConfig(1e-6)
    args = make(3, 4, 2, 64, (3, 2, 2, 64), act, [1, -1, 4], pool_dtype=pool)
    check(qk_norm_rope_pool_fused_reference(*args, rope=rope, norm=norm), args, rope, norm, act)
    check(native_kernel(rope, norm)(*args[:5], mx.array(args[5]), mx.array(args[6]), *args[7:]), args, rope, norm, act)


@pytest.mark.parametrize("module, offset", [("nn", 0.0), ("gemma3", 1.0)])
def test_reference_is_the_models_own_norm_then_rope(module, offset):
    """qwen3-style nn.RMSNorm (w) and gemma3's RMSNorm (1 + w), then nn.RoPE: the reference agrees
    with the modules (fp32, where both are exact up to rounding)."""
    from registry.integrations.mlx_lm import import_mlx_lm_module

    D = 64
    norm_mod = nn.RMSNorm(D, eps=1e-6) if module == "nn" else import_mlx_lm_module("gemma3_text").RMSNorm(D, eps=1e-6)
    norm_mod.weight = mx.random.normal((D,), key=mx.random.key(1)) * 0.3
    cfg = normalize_qk_norm(norm_mod, D)
    assert cfg == NormConfig(1e-6, offset, type(norm_mod).__name__)
    rope_mod = nn.RoPE(D, base=10000.0)
    args = make(3, 4, 2, D, (4, 2, D), "float32", [0, 1, 2])
    q, k, v, pos, slots, kp, vp = args[:7]
    pos = mx.array([7, 8, 9], dtype=mx.int32)
    q_out, k_out, _, _ = qk_norm_rope_pool_fused_reference(q, k, v, pos, slots, kp, vp, norm_mod.weight,
                                                           norm_mod.weight, rope=rope_mod, norm=cfg)
    # The module path on [B=1, H, L=T, D] at offset 7: token t at position 7 + t.
    own_q = rope_mod(norm_mod(q).transpose(1, 0, 2)[None], offset=7)[0].transpose(1, 0, 2)
    np.testing.assert_allclose(np.array(q_out), np.array(own_q), atol=1e-5, rtol=1e-5)
    own_k = rope_mod(norm_mod(k).transpose(1, 0, 2)[None], offset=7)[0].transpose(1, 0, 2)
    np.testing.assert_allclose(np.array(k_out), np.array(own_k), atol=1e-5, rtol=1e-5)


def test_norm_probe_refuses_what_is_not_a_per_head_rmsnorm():
    with pytest.raises(UnsupportedNorm, match="normalises 128 features, not one head of 64"):
        normalize_qk_norm(nn.RMSNorm(128), 64)
    with pytest.raises(UnsupportedNorm, match="has a bias"):
        normalize_qk_norm(nn.LayerNorm(64), 64)
    ln = nn.LayerNorm(64, affine=True, bias=False)
    with pytest.raises(UnsupportedNorm, match="computes neither"):
        normalize_qk_norm(ln, 64)

    class Attn:
        q_norm, k_norm = nn.RMSNorm(64, eps=1e-6), nn.RMSNorm(64, eps=1e-5)
    assert describe_qk_norm(Attn(), 64) == (None, "q and k norms differ (eps 1e-06/1e-05, weight offset 0/0)")
    assert describe_qk_norm(object(), 64) == (None, "the attention has no per-head q/k norm")


@pytest.mark.parametrize("mutate, message", [
    (lambda a: (*a[4:5], *a[1:]), r"q must be 3-D"),
    (lambda a: (*a[:7], a[7][:4], a[8]), r"q_weight must be a float \[head_dim=8\] array"),
    (lambda a: (*a[:8], a[8].astype(mx.int32)), r"k_weight must be a float \[head_dim=8\] array"),
    (lambda a: (*a[:3], a[3].astype(mx.float32), *a[4:]), r"positions must be int32 \[tokens=3\]"),
    (lambda a: (*a[:5], a[5][..., :4], a[6][..., :4], *a[7:]), r"k_pool 6x2x4: a slot-major pool must be"),
])
def test_argument_errors_name_the_argument(mutate, message):
    args = mutate(make(3, 4, 2, 8, (6, 2, 8), "float32", [0, 1, 2]))
    with pytest.raises(KernelArgumentError, match=message):
        qk_norm_rope_pool_fused(*args, rope=RopeConfig(8), norm=NormConfig(1e-6))


@pytest.mark.parametrize("native", [True, False])
def test_checked_slots_and_positions(native_artifacts, native):
    rope, norm = RopeConfig(8), NormConfig(1e-6)
    kernel = native_kernel(rope, norm) if native else QkNormRopePoolFusedKernel((rope, norm), backend="cpu")
    args = make(3, 4, 2, 8, (6, 2, 8), "float16", [0, 6, 1])
    with pytest.raises(KernelArgumentError, match=r"slots\[1\]=6 is out of range for a pool of 6 slots"):
        kernel(*args)
    args = make(3, 4, 2, 8, (6, 2, 8), "float16", [3, -1, 3])
    with pytest.raises(KernelArgumentError, match=r"slots\[2\]=3 repeats slots\[0\]"):
        kernel(*args)
    args = list(make(3, 4, 2, 8, (6, 2, 8), "float16", [0, 1, 2]))
    args[3] = mx.array([0, -2, 2**24 + 1], dtype=mx.int32)
    with pytest.raises(KernelArgumentError, match=r"positions\[1\]=-2 is outside \[0, 2\^24 = 16777216\]"):
        kernel(*args)
    kernel(*args, check_slots=False)   # unchecked: computed as float(position) * pos_scale * inv_freq


def test_bad_norm_config():
    with pytest.raises(KernelArgumentError, match="norm must be a registry.norm.NormConfig, got float"):
        qk_norm_rope_pool_fused(*make(1, 1, 1, 8, (2, 1, 8), "float32", [0]), rope=RopeConfig(8), norm=1e-6)


def test_inconsistent_head_major_scalars_never_divide_by_zero(native_artifacts):
    rope, norm = RopeConfig(8), NormConfig(1e-6)
    kernel = native_kernel(rope, norm)
    args = make(2, 2, 2, 8, (2, 2, 0, 8), "float32", [0, 3])
    key, scalars, grid, group = kernel.launch_config(*args)
    out = kernel._launcher.run(kernel._launcher.plan(key, dict(scalars, pool_size=4), grid=grid, threadgroup=group),
                               kernel.launch_arrays(*args))
    mx.eval(out)
    want = oracle(args, rope, norm)
    np.testing.assert_allclose(to_np(out[1]), want[1], atol=2 * TOL["float32"], rtol=2 * TOL["float32"])
    assert out[2].shape == (2, 2, 0, 8)


def test_the_weight_table_follows_the_weight_arrays(native_artifacts):
    """The native kernels take the norm weights and the RoPE table as one buffer (norm_rope_table). The
    kernel object makes it once per pair of weight arrays and reuses it while those same arrays come
    back; other arrays, or the same Python object updated in place (a new MLX array), get their own."""
    rope, norm = RopeConfig(64), NormConfig(1e-6, 1.0)
    kernel = native_kernel(rope, norm)
    args = list(make(2, 4, 2, 64, (4, 2, 64), "float32", [1, 3]))
    run = lambda a: kernel(*a[:5], mx.array(a[5]), mx.array(a[6]), *a[7:])
    check(run(args), args, rope, norm, "float32")
    table = kernel._table(args[7], args[8])
    check(run(args), args, rope, norm, "float32")
    assert kernel._table(args[7], args[8]) is table
    args[7][:8] = 3.0                          # in place: the same Python object holds a new array
    assert kernel._table(args[7], args[8]) is not table
    check(run(args), args, rope, norm, "float32")
    args[8] = args[8] * 2                      # another array object
    check(run(args), args, rope, norm, "float32")


def test_weights_of_another_float_dtype_go_to_the_kernel_exactly(native_artifacts):
    """bf16 activations with f32 norm weights: the table holds the weights in fp32, as the reference's
    fp32 math takes them (no rounding to the activations' dtype first)."""
    rope, norm = RopeConfig(64), NormConfig(1e-6)
    args = list(make(3, 4, 2, 64, (4, 2, 64), "bfloat16", [0, 2, -1]))
    rng = np.random.default_rng(7)
    args[7], args[8] = (mx.array((1 + 0.01 * rng.standard_normal(64)).astype(np.float32)) for _ in range(2))
    got = native_kernel(rope, norm)(*args[:5], mx.array(args[5]), mx.array(args[6]), *args[7:])
    ref = qk_norm_rope_pool_fused_reference(*args, rope=rope, norm=norm)
    for name, g, r in zip(("q_out", "k_out", "k_pool", "v_pool"), got, ref):
        np.testing.assert_allclose(to_np(g), to_np(r), atol=TOL["bfloat16"], rtol=TOL["bfloat16"], err_msg=name)


def test_derived_arrays_are_bounded():
    from registry.kernels._base import DerivedArray

    made = []
    derived = DerivedArray(lambda a, b: made.append(1) or a + b, limit=2)
    xs = [mx.array([float(i)]) for i in range(3)]
    for _ in range(2):
        assert derived(xs[0], xs[1]).item() == 1.0
    assert len(made) == 1
    derived(xs[1], xs[2]), derived(xs[2], xs[0])     # the third entry starts the cache again
    assert len(derived._entries) == 1 and len(made) == 3
