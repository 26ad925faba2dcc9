"""rope_pool_fused at its limits (docs/kernel-abi.md, "Limits"), on the reference path and the
native kernel of the default device (the CPU in CI, the GPU on a GPU host); the emulated Metal
kernel repeats them in tests/test_metal_emulation.py:
- duplicate valid slots in one call: a KernelArgumentError with check_slots=True; unchecked, one of
  the tokens' rows lands and nothing else changes;
- positions: refused outside [0, 2^24] when checked; unchecked, every path computes
  float(position) * pos_scale * inv_freq (negative and INT32 extremes included) and they agree;
- pools of more than INT32_MAX slots: a KernelArgumentError naming the limit, before any packing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelArgumentError, rope_pool_fused_reference
from registry.kernels.rope_pool_fused import RopePoolFusedKernel
from registry.rope import RopeConfig
from tests._oracle import by_slot, rope_pool_numpy
from tests.rope_cases import TOL, make_case, rope_variant, to_np
from tests.test_native_rope_pool_fused import native_kernel

INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
EXTREME_POSITIONS = [-1, -5000, INT32_MAX, INT32_MIN, 2**24, 2**24 + 1, 123456789, 0, 4095]


@pytest.fixture(params=["reference", "native"])
def make_kernel(request):
    """A factory rope -> kernel object: the reference path, or the native kernel of this device."""
    if request.param == "reference":
        return lambda rope: RopePoolFusedKernel(rope, backend="cpu", reason="test: reference path")
    request.getfixturevalue("native_artifacts")
    return native_kernel


@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
def test_duplicate_valid_slots_are_refused_when_checked(make_kernel, batch):
    kernel = make_kernel(RopeConfig(64))
    args = make_case(5, 4, 2, 64, 4, "float32", [3, -1, 1, -1, 3], batch=batch)
    with pytest.raises(KernelArgumentError, match=r"slots\[4\]=3 repeats slots\[0\]: a slot may be written once"):
        kernel(*args)
    # Negative slots may repeat (they write nothing), and so may out-of-range ones when unchecked.
    kernel(*args[:4], mx.array([3, -1, 1, -1, 0], dtype=mx.int32), *args[5:])


@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
def test_unchecked_duplicate_slots_write_one_of_the_rows(make_kernel, batch):
    """The caller's contract when unchecked: every element of the slot's k and v rows is that element
    of one of its tokens' rows (which token is unspecified and may differ element by element,
    docs/kernel-abi.md: the CUDA kernel spreads a decode row over a thread per feature pair, and MLX's
    scatter on CUDA, which the reference path uses, resolves a repeated index per element). Every
    other row is as it would be without the repeat, nothing else changes."""
    rope = RopeConfig(32)
    slots = [2, 5, 2, 2**31 - 1, 0, 5]
    args = make_case(len(slots), 4, 2, 32, 6, "float16", slots, batch=batch)
    before = by_slot(to_np(args[5]))
    kernel = make_kernel(rope)
    _, k_rot, kp, vp = kernel(*args[:5], mx.array(args[5]), mx.array(args[6]), check_slots=False)
    k_rows, v_rows = by_slot(to_np(kp)), by_slot(to_np(vp))
    for slot, tokens in ((2, (0, 2)), (5, (1, 5)), (0, (4,))):
        for what, got, rows in (("k", k_rows[slot], [to_np(k_rot[t]) for t in tokens]),
                                ("v", v_rows[slot], [to_np(args[2][t]) for t in tokens])):
            assert np.all(np.any([got == r for r in rows], axis=0)), \
                f"slot {slot}: some {what} element is none of tokens {tokens}' elements"
    untouched = [s for s in range(by_slot(before).shape[0]) if s not in (0, 2, 5)]
    np.testing.assert_array_equal(k_rows[untouched], before[untouched])


@pytest.mark.parametrize("bad, shown", [(-1, "-1"), (INT32_MIN, str(INT32_MIN)), (2**24 + 1, str(2**24 + 1)),
                                        (INT32_MAX, str(INT32_MAX))])
def test_positions_outside_the_fp32_range_are_refused_when_checked(make_kernel, bad, shown):
    kernel = make_kernel(RopeConfig(64))
    q, k, v, pos, slots, kp, vp = make_case(3, 4, 2, 64, 4, "float32", [0, 1, 2])
    pos = mx.array([5, bad, 7], dtype=mx.int32)
    with pytest.raises(KernelArgumentError, match=rf"positions\[1\]={shown} is outside \[0, 2\^24 = 16777216\]"):
        kernel(q, k, v, pos, slots, kp, vp)
    kernel(q, k, v, mx.array([0, 2**24, 3], dtype=mx.int32), slots, kp, vp)   # the bounds themselves are fine


@pytest.mark.parametrize("variant", ["full-base", "partial-base-scaled", "full-traditional-freqs"])
@pytest.mark.parametrize("batch", [None, 3], ids=["slot-major", "head-major"])
def test_unchecked_extreme_positions_agree_on_every_path(native_artifacts, variant, batch):
    """Negative, > 2^24 and INT32 extreme positions: the native kernel and the reference compute the
    same fp32 angles (issue 12 item 29: they differed by up to 5.5 before)."""
    rope = rope_variant(variant, 64)
    args = list(make_case(9, 4, 2, 64, 9 if batch is None else 3, "float32", list(range(9)), batch=batch))
    args[3] = mx.array(EXTREME_POSITIONS, dtype=mx.int32)
    got = native_kernel(rope)(*args[:5], mx.array(args[5]), mx.array(args[6]), check_slots=False)
    ref = rope_pool_fused_reference(*args, rope=rope)
    for name, g, r in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, ref):
        np.testing.assert_allclose(to_np(g), to_np(r), atol=1e-5, rtol=1e-5, err_msg=name)
    # At ordinary positions the float64 oracle agrees too (near 2^24, fp32 angle rounding reaches a
    # radian: that is why checked calls refuse beyond it).
    ok = [t for t, p in enumerate(EXTREME_POSITIONS) if 0 <= p <= 5000]
    want = rope_pool_numpy(*[to_np(a) for a in args], rope)[0]
    np.testing.assert_allclose(to_np(got[0])[ok], want[ok], atol=TOL["float32"], rtol=TOL["float32"])


def test_negative_positions_rotate_backwards(make_kernel):
    """Unchecked, position -p is the inverse rotation of +p, on every path."""
    rope = RopeConfig(64)
    kernel = make_kernel(rope)
    q, k, v, _, slots, kp, vp = make_case(2, 4, 2, 64, 4, "float32", [-1, -1])
    fwd = kernel(q, k, v, mx.array([300, 7], dtype=mx.int32), slots, kp, vp, check_slots=False)[0]
    back = kernel(fwd, k, v, mx.array([-300, -7], dtype=mx.int32), slots, kp, vp, check_slots=False)[0]
    np.testing.assert_allclose(to_np(back), to_np(q), atol=TOL["float32"])


@pytest.mark.parametrize("shape, n", [((2**16, 1, 2**15, 2), 2**31), ((3, 1, 2**30, 2), 3 * 2**30)])
def test_pools_beyond_int32_slots_are_refused_before_packing(make_kernel, shape, n):
    """Head-major pools of B * S > INT32_MAX slots (MLX's int32 dims keep slot-major ones below),
    lazy and never allocated: the shape alone is refused, naming the limit."""
    kernel = make_kernel(RopeConfig(2))
    q, k, v, pos, s, _, _ = make_case(1, 1, 1, 2, 1, "float16", [0])
    pool = mx.zeros(shape, dtype=mx.float16)
    with pytest.raises(KernelArgumentError, match=rf"holds {n} slots, more than INT32_MAX = 2147483647"):
        kernel(q, k, v, pos, s, pool, pool, check_slots=False)


def test_inconsistent_head_major_scalars_never_divide_by_zero(native_artifacts):
    """A raw launch whose pool_size (4) disagrees with pool_rows (0): the kernel writes nothing
    rather than dividing by zero rows (SIGFPE on x86)."""
    rope = RopeConfig(64)
    kernel = native_kernel(rope)
    launcher = kernel._launcher
    q, k, v, pos, slots, kp, vp = make_case(2, 2, 2, 64, 0, "float32", [0, 3], batch=2)
    # The wrapper's own launch (geometry, every scalar), with pool_size made to disagree with pool_rows.
    key, scalars, grid, group = kernel.launch_config(q, k, v, pos, slots, kp, vp)
    assert (scalars["pool_rows"], scalars["pool_layout"]) == (0, 1)
    plan = launcher.plan(key, dict(scalars, pool_size=4), grid=grid, threadgroup=group)
    out = launcher.run(plan, [q, k, v, kp, vp, pos, slots, mx.array(rope.inv_freq())])
    mx.eval(out)
    np.testing.assert_allclose(to_np(out[1]), rope_pool_numpy(*[to_np(a) for a in (q, k, v, pos, slots, kp, vp)],
                                                              rope)[1], atol=TOL["float32"])
    assert out[2].shape == (2, 2, 0, 64)
