"""kv_pool_store: the native kernel of the default device (CPU in CI, the GPU on the GPU host) and the
reference against a NumPy oracle, both pool layouts, mixed dtypes on the reference, the slot check,
argument errors and the CUDA vector width's one source."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelRegistry
from registry.errors import KernelArgumentError
from registry.kernels.kv_pool_store import KvPoolStoreKernel, kv_pool_store, kv_pool_store_reference
from registry.core import backend_of
from tests.rope_cases import MX_DTYPES, to_np

SPEC = KernelRegistry.from_yaml().manifest.kernel("kv_pool_store")
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31


def native_kernel() -> KvPoolStoreKernel:
    backend = backend_of(None)
    kernel = KvPoolStoreKernel.build(SPEC, KvPoolStoreKernel.context_for(None, backend))
    assert kernel.implementation == f"native-{backend}", kernel.reason
    return kernel


def store_numpy(pool: np.ndarray, slots, rows: np.ndarray) -> np.ndarray:
    """Float64 oracle, written from docs/kernel-abi.md: both layouts, slot < 0 or >= size skipped."""
    out = np.asarray(pool, np.float64).copy()
    head_major = out.ndim == 4
    S = out.shape[2] if head_major else out.shape[0]
    size = out.shape[0] * S if head_major else S
    for t, slot in enumerate(slots):
        if 0 <= slot < size:
            if head_major:
                out[slot // S, :, slot % S] = rows[t]
            else:
                out[slot] = rows[t]
    return out


def case(T, H, D, pool_shape, act, pool, slots, seed=0):
    rng = np.random.default_rng(seed)
    arr = lambda shape, dt: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[dt])
    return (arr((T, H, D), act), arr((T, H, D), act), mx.array(np.asarray(slots, np.int32)),
            arr(pool_shape, pool), arr(pool_shape, pool))


def check(got, args):
    k, v, slots, kp, vp = args
    want_k = store_numpy(to_np(kp), np.asarray(slots), to_np(k.astype(kp.dtype)))
    want_v = store_numpy(to_np(vp), np.asarray(slots), to_np(v.astype(vp.dtype)))
    for name, g, w, p in (("k_pool", got[0], want_k, kp), ("v_pool", got[1], want_v, vp)):
        assert g.shape == p.shape and g.dtype == p.dtype, name
        np.testing.assert_array_equal(to_np(g), w, err_msg=name)   # a store is exact: one conversion


LAYOUTS = {"slot-major": (9, 2, 40), "head-major": (3, 2, 3, 40)}


@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_native_matches_oracle_and_reference(native_artifacts, dtype, layout):
    slots = [4, -1, 0, 8, INT32_MIN, 2]
    args = case(6, 2, 40, LAYOUTS[layout], dtype, dtype, slots, seed=len(layout))
    check(kv_pool_store_reference(*args), args)
    check(native_kernel()(*args[:3], mx.array(args[3]), mx.array(args[4])), args)


@pytest.mark.parametrize("head_dim", [1, 3, 8, 64, 100, 128, 256])
def test_head_dims_and_unchecked_out_of_range_slots(native_artifacts, head_dim):
    """Odd and narrow rows; slots >= pool size up to INT32_MAX are never written when unchecked."""
    args = case(5, 3, head_dim, (4, 3, head_dim), "float16", "float16", [3, 4, INT32_MAX, -7, 0], seed=head_dim)
    check(native_kernel()(*args[:3], mx.array(args[3]), mx.array(args[4]), check_slots=False), args)


MIXED = [(a, p) for a in MX_DTYPES for p in MX_DTYPES if a != p]


@pytest.mark.parametrize("act, pool", MIXED)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_dtypes_convert_on_the_store(native_artifacts, act, pool, layout):
    """Pools of another float dtype than k/v (an f32 pool for bf16 activations, ...): one rounding."""
    args = case(4, 2, 40, LAYOUTS[layout], act, pool, [1, -1, 6, 0])
    check(kv_pool_store_reference(*args), args)
    check(native_kernel()(*args[:3], mx.array(args[3]), mx.array(args[4])), args)


def test_empty_batch_and_pool(native_artifacts):
    kernel = native_kernel()
    args = case(0, 2, 16, (4, 2, 16), "float32", "float32", [])
    check(kernel(*args), args)
    args = case(2, 2, 16, (0, 2, 16), "float32", "float32", [-1, -1])
    check(kernel(*args), args)


def test_pools_are_written_in_place(native_artifacts):
    args = case(2, 2, 16, (4, 2, 16), "float32", "float32", [1, 3])
    kp, vp = args[3], args[4]
    mx.eval(kp, vp)
    kp_new, vp_new = native_kernel()(*args[:3], kp, vp)
    mx.eval(kp_new, vp_new)
    assert mx.array_equal(kp, kp_new) and mx.array_equal(vp, vp_new)   # the passed arrays see the write


@pytest.mark.parametrize("slots, message", [
    ([0, 9], r"slots\[1\]=9 is out of range for a pool of 9 slots"),
    ([2, -1, 2], r"slots\[2\]=2 repeats slots\[0\]: a slot may be written once per call"),
])
@pytest.mark.parametrize("native", [True, False])
def test_checked_slots(native_artifacts, slots, message, native):
    args = case(len(slots), 2, 8, (9, 2, 8), "float16", "float16", slots)
    kernel = native_kernel() if native else KvPoolStoreKernel(backend="cpu")
    with pytest.raises(KernelArgumentError, match=message):
        kernel(*args)
    kernel(*args[:3], mx.array(args[3]), mx.array(args[4]), check_slots=False)  # unchecked: caller's contract


def test_repeated_invalid_slots_are_no_duplicates():
    args = case(4, 2, 8, (3, 2, 8), "float32", "float32", [-1, -1, 1, -5])
    check(KvPoolStoreKernel(backend="cpu")(*args), args)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: (a[0].astype(mx.int32), *a[1:]), r"k dtype mlx.core.int32 is not float16"),
    (lambda a: (a[0], a[1].astype(mx.float16), *a[2:]), r"v dtype mlx.core.float16 differs from k dtype mlx.core.float32"),
    (lambda a: (a[0][:, :1], *a[1:]), r"k 3x1x8 and v 3x2x8 must have the same shape"),
    (lambda a: (*a[:2], a[2].astype(mx.int64), *a[3:]), r"slots must be int32 \[tokens=3\]"),
    (lambda a: (*a[:3], a[3].astype(mx.int32), a[4]), r"k_pool dtype mlx.core.int32 is not float16, bfloat16 or float32"),
    (lambda a: (*a[:3], a[3], a[4].astype(mx.float16)), r"v_pool dtype mlx.core.float16 differs from k_pool dtype"),
    (lambda a: (*a[:3], a[3][:, :, :4], a[4][:, :, :4]),
     r"k_pool 5x2x4: a slot-major pool must be \[pool_size, n_kv_heads=2, head_dim=8\]"),
    (lambda a: (*a[:3], a[3][0], a[4]), r"k_pool must be a slot-major \[pool_size, n_kv_heads, head_dim\] \(3-D\) or"),
    (lambda a: (a[0].tolist(), *a[1:]), r"k must be an mx.array, got list"),
])
def test_argument_errors_name_the_argument(mutate, message):
    args = mutate(case(3, 2, 8, (5, 2, 8), "float32", "float32", [0, 1, 2]))
    with pytest.raises(KernelArgumentError, match=message):
        kv_pool_store(*args)


def test_wrong_argument_count():
    with pytest.raises(KernelArgumentError, match=r"expected 5 arguments \(k, v, slots, k_pool, v_pool\), got 4"):
        KvPoolStoreKernel(backend="cpu")(*case(1, 1, 2, (2, 1, 2), "float32", "float32", [0])[:4])



def test_selected_with_its_own_reason_where_rope_kernel_is_not():
    """kv_store needs no RoPE: selected for a layer whose rope the fused kernel cannot serve."""
    class Attn:
        n_heads = 4
        rope = None
    kset = KernelRegistry.from_yaml().build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=8)
    assert kset.kv_store is not None and kset.rope is None


def test_inconsistent_head_major_scalars_never_divide_by_zero(native_artifacts):
    """A raw launch whose pool_size (4) disagrees with pool_rows (0) of a head-major pool: the kernel
    writes nothing rather than dividing by zero rows (SIGFPE on x86)."""
    kernel = native_kernel()
    args = case(2, 2, 8, (2, 2, 0, 8), "float32", "float32", [0, 3])
    key, scalars, grid, group = kernel.launch_config(*args)
    assert (scalars["pool_rows"], scalars["pool_layout"]) == (0, 1)
    out = kernel._launcher.run(kernel._launcher.plan(key, dict(scalars, pool_size=4), grid=grid, threadgroup=group),
                               kernel.launch_arrays(*args))
    mx.eval(out)
    assert out[0].shape == (2, 2, 0, 8) and out[1].shape == (2, 2, 0, 8)
