"""The pure-MLX reference path (fallback and oracle) against the independent NumPy oracle."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelArgumentError, rope_pool_fused, rope_pool_fused_reference
from registry.rope import RopeConfig
from tests._oracle import rope_pool_numpy
from tests.rope_cases import TOL, make_case, to_np

def check_against_oracle(out, args, rope, dtype):
    ref = rope_pool_numpy(*[to_np(a) for a in args], rope)
    for name, got, want in zip(("q_rot", "k_rot", "k_pool", "v_pool"), out, ref):
        assert got.dtype == args[0].dtype, name
        np.testing.assert_allclose(to_np(got), want, atol=TOL[dtype], rtol=TOL[dtype], err_msg=name)


ROPES = {
    "base": RopeConfig(64),
    "partial": RopeConfig(32, base=1e6),
    "traditional": RopeConfig(64, traditional=True),
    "partial-traditional": RopeConfig(16, traditional=True, base=500.0),
    "periods": RopeConfig(64, base=None, periods=tuple(float(2 ** (i / 4)) for i in range(32))),
    "proportional": RopeConfig(64, base=None, periods=tuple([10.0 ** (i / 8) for i in range(8)] + [float("inf")] * 24)),
    "scaled": RopeConfig(64, pos_scale=0.125, mscale=1.25),
}


@pytest.mark.parametrize("dtype, rope_name, gqa", list(itertools.product(
    ["float32", "float16", "bfloat16"], list(ROPES), [1, 4, 7])))
def test_reference_matches_oracle(dtype, rope_name, gqa):
    Hkv = 2 if gqa != 7 else 1
    T, S = 6, 16
    slots = [3, -1, 0, 15, -1, 7]
    args = make_case(T, Hkv * gqa, Hkv, 64, S, dtype, slots, seed=gqa)
    out = rope_pool_fused_reference(*args, rope=ROPES[rope_name])
    check_against_oracle(out, args, ROPES[rope_name], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rope_name", ["partial", "traditional"])
def test_head_major_pools_match_oracle(dtype, rope_name):
    """mlx-lm's [B, Hkv, S, D] layout: slot b * S + s is [b, :, s, :]; out-of-range and negative
    slots are skipped, the pool keeps its shape."""
    B, S = 3, 4
    slots = [0, 11, -1, 5, 12, 2 ** 31 - 1, 4]
    args = make_case(len(slots), 4, 2, 64, S, dtype, slots, seed=5, batch=B)
    out = rope_pool_fused_reference(*args, rope=ROPES[rope_name])
    assert out[2].shape == out[3].shape == (B, 2, S, 64)
    check_against_oracle(out, args, ROPES[rope_name], dtype)
    assert mx.array_equal(out[3][1, :, 1], args[2][3])   # slot 5 = batch 1, row 1
    assert mx.array_equal(out[3][2, :, 3], args[2][1])   # slot 11 = the last row of the last batch


def test_head_major_lazy_no_host_sync():
    """The reference builds its graph without reading slots on the host (usable inside mx.compile)."""
    args = make_case(2, 2, 2, 16, 4, "float32", [1, 6], batch=2)
    f = mx.compile(lambda *a: rope_pool_fused_reference(*a, rope=RopeConfig(16)))
    out = f(*args)
    check_against_oracle(out, args, RopeConfig(16), "float32")


def test_pass_through_features_are_bit_exact():
    args = make_case(4, 4, 2, 128, 8, "bfloat16", [0, 1, 2, 3])
    q_rot, k_rot, kp, _ = rope_pool_fused_reference(*args, rope=RopeConfig(64))
    assert mx.array_equal(q_rot[..., 64:], args[0][..., 64:])
    assert mx.array_equal(kp[:4, :, 64:], args[1][..., 64:])


def test_all_slots_negative_leaves_pools_unchanged():
    args = make_case(3, 2, 2, 16, 4, "float32", [-1, -1, -5])
    _, _, kp, vp = rope_pool_fused_reference(*args, rope=RopeConfig(16))
    assert mx.array_equal(kp, args[5]) and mx.array_equal(vp, args[6])


def test_rows_not_written_are_untouched_and_input_pool_object_unchanged():
    args = make_case(3, 2, 2, 16, 6, "float32", [5, -1, 1])
    before = np.array(args[5])
    _, _, kp, _ = rope_pool_fused_reference(*args, rope=RopeConfig(16))
    for row in (0, 2, 3, 4):
        np.testing.assert_array_equal(np.array(kp[row]), before[row])
    np.testing.assert_array_equal(np.array(args[5]), before)  # reference never aliases


def test_out_of_range_slot_is_an_error_and_never_written():
    args = make_case(2, 2, 2, 16, 4, "float32", [1, 4])
    with pytest.raises(KernelArgumentError, match=r"slots\[1\]=4 is out of range for a pool of 4 slots"):
        rope_pool_fused(*args, rope=RopeConfig(16))
    # With the per-call check off (engines validate once per step), the row is skipped, not written.
    _, _, kp, _ = rope_pool_fused(*args, rope=RopeConfig(16), check_slots=False)
    np.testing.assert_array_equal(np.array(kp[[0, 2, 3]]), np.array(args[5][[0, 2, 3]]))


def test_head_major_out_of_range_slot_is_an_error():
    args = make_case(2, 2, 2, 16, 4, "float32", [7, 8], batch=2)
    with pytest.raises(KernelArgumentError, match=r"slots\[1\]=8 is out of range for a pool of 8 slots"):
        rope_pool_fused(*args, rope=RopeConfig(16))


def test_zero_tokens():
    args = make_case(0, 4, 2, 16, 4, "float16", [])
    out = rope_pool_fused(*args, rope=RopeConfig(16))
    assert out[0].shape == (0, 4, 16) and mx.array_equal(out[2], args[5])


def _bad(**over):
    args = dict(zip(("q", "k", "v", "positions", "slots", "k_pool", "v_pool"),
                    make_case(3, 4, 2, 16, 8, "float16", [0, 1, 2])))
    args.update(over)
    return args


@pytest.mark.parametrize("over, message", [
    (dict(q=np.zeros((3, 4, 16))), "q must be an mx.array, got ndarray"),
    (dict(q=mx.zeros((3, 64), dtype=mx.float16)), r"q must be 3-D \[tokens, heads, head_dim\] or 4-D \[batch, heads, seq_len, head_dim\], got shape 3x64"),
    (dict(q=mx.zeros((3, 4, 16), dtype=mx.int32)), "q dtype mlx.core.int32 is not float16, bfloat16 or float32"),
    (dict(k=mx.zeros((3, 2, 16))), "k dtype mlx.core.float32 differs from q dtype"),
    (dict(v=mx.zeros((3, 1, 16), dtype=mx.float16)), r"k 3x2x16 and v 3x1x16 must have the same shape"),
    (dict(k=mx.zeros((2, 2, 16), dtype=mx.float16), v=mx.zeros((2, 2, 16), dtype=mx.float16)),
     r"k 2x2x16 must be \[tokens=3, n_kv_heads, head_dim=16\]"),
    (dict(k=mx.zeros((3, 3, 16), dtype=mx.float16), v=mx.zeros((3, 3, 16), dtype=mx.float16)),
     "q has 4 heads, not a multiple of k's 3 heads"),
    (dict(k_pool=mx.zeros((8, 2, 32), dtype=mx.float16)),
     r"k_pool 8x2x32: a slot-major pool must be \[pool_size, n_kv_heads=2, head_dim=16\]"),
    (dict(v_pool=mx.zeros((1, 3, 8, 16), dtype=mx.float16)),
     r"v_pool 1x3x8x16: a head-major pool must be \[batch, n_kv_heads=2, rows, head_dim=16\]"),
    (dict(k_pool=mx.zeros((8, 32), dtype=mx.float16)),
     r"k_pool must be a slot-major \[pool_size, n_kv_heads, head_dim\] \(3-D\) or head-major "
     r"\[batch, n_kv_heads, rows, head_dim\] \(4-D\) pool, got shape 8x32"),
    (dict(k_pool=mx.zeros((2, 2, 4, 16), dtype=mx.float16)),
     "k_pool 2x2x4x16 and v_pool 8x2x16 must have the same shape"),
    (dict(v_pool=mx.zeros((9, 2, 16), dtype=mx.float16)), "k_pool 8x2x16 and v_pool 9x2x16 must have the same shape"),
    (dict(positions=mx.zeros((3,), dtype=mx.int64)), r"positions must be int32 \[tokens=3\], got mlx.core.int64 3"),
    (dict(slots=mx.zeros((4,), dtype=mx.int32)), r"slots must be int32 \[tokens=3\], got mlx.core.int32 4"),
])
def test_bad_arguments_name_argument_and_shapes(over, message):
    with pytest.raises(KernelArgumentError, match=message):
        rope_pool_fused(**_bad(**over), rope=RopeConfig(16))


def test_odd_head_dim_and_too_many_rotary_dims():
    args = make_case(2, 2, 2, 14, 4, "float32", [0, 1])
    with pytest.raises(KernelArgumentError, match="rotary_dims=16 exceeds head_dim=14"):
        rope_pool_fused(*args, rope=RopeConfig(16))
    odd = [mx.zeros((2, 2, 15)) for _ in range(3)]
    with pytest.raises(KernelArgumentError, match="head_dim=15 must be even"):
        rope_pool_fused(*odd, mx.zeros((2,), dtype=mx.int32), mx.zeros((2,), dtype=mx.int32),
                        mx.zeros((4, 2, 15)), mx.zeros((4, 2, 15)), rope=RopeConfig(8))


def test_unsupported_rope_module_is_an_argument_error():
    class NotRope:
        pass
    with pytest.raises(KernelArgumentError, match="rope: unknown RoPE class"):
        rope_pool_fused(*make_case(1, 2, 2, 16, 4, "float32", [0]), rope=NotRope())
