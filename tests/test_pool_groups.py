"""The pool groups of registry/kernels/_base.py (docs/kernel-abi.md, "Pool groups"): float K/V pools or
mlx-lm's quantized ones (uint32 words, scales, biases), either layout, checked member by member with
errors that name the array and what was expected; the reference stores of a group."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry.errors import KernelArgumentError
from registry.kernels._base import (FLOAT_POOLS, HEAD_MAJOR, SLOT_MAJOR, PoolFormat, check_pools, group_rows,
                                    store_group)


def quant_pools(lead, H, D, bits=8, gs=64, dtype=mx.bfloat16):
    """Zero quantized pools for both sides: `lead` = (S,) slot-major or (B, S) head-major."""
    W, G = D * bits // 32, D // gs
    shape = lambda w: (*lead[:-1], H, lead[-1], w) if len(lead) == 2 else (*lead, H, w)
    arrays = {}
    for side in "kv":
        arrays[f"{side}_pool"] = mx.zeros(shape(W), mx.uint32)
        arrays[f"{side}_scales"] = mx.zeros(shape(G), dtype)
        arrays[f"{side}_biases"] = mx.zeros(shape(G), dtype)
    return arrays


@pytest.mark.parametrize("lead, layout", [((10,), SLOT_MAJOR), ((2, 5), HEAD_MAJOR)])
@pytest.mark.parametrize("bits, gs", [(4, 32), (8, 64), (4, 128), (8, 128)])
def test_quantized_groups_pass(lead, layout, bits, gs):
    fmt = PoolFormat(bits, gs)
    geo = check_pools("k", quant_pools(lead, 2, 128, bits, gs), 2, 128, fmt)
    assert (geo.layout, geo.size, geo.heads, geo.dim) == (layout, 10, 2, 128 * bits // 32)
    assert fmt.names("v") == ("v_pool", "v_scales", "v_biases") and fmt.widths(128) == (128 * bits // 32, 128 // gs,
                                                                                        128 // gs)
    assert FLOAT_POOLS.names("k") == ("k_pool",) and FLOAT_POOLS.widths(128) == (128,)


def _edit(name, make):
    def apply(p):
        p[name] = make(p[name])
        return p
    return apply


BAD = [
    (PoolFormat(3, 64), None, r"k: bits=3: the kernel stores 4- or 8-bit rows"),
    (PoolFormat(8, 48), None, r"group_size=48 is not one of 32, 64, 128"),
    (PoolFormat(8, 128), None, r"group_size=128 does not divide head_dim=96"),
    (PoolFormat(8, 32), _edit("k_scales", lambda a: a[..., :2]),
     r"k_scales 10x2x2: a slot-major pool must be \[pool_size, n_kv_heads=2, head_dim/32=3\]"),
    (PoolFormat(8, 32), _edit("v_biases", lambda a: a.astype(mx.float32)),
     r"v_biases dtype mlx.core.float32 differs from k_scales dtype mlx.core.bfloat16"),
    (PoolFormat(8, 32), _edit("k_scales", lambda a: a.astype(mx.int32)),
     r"k_scales dtype mlx.core.int32 is not float16, bfloat16 or float32"),
    (PoolFormat(8, 32), _edit("v_pool", lambda a: a[..., :4]),
     r"v_pool 10x2x4: a slot-major pool must be \[pool_size, n_kv_heads=2, head_dim\*8/32=24\]"),
    (PoolFormat(8, 32), _edit("k_pool", lambda a: a.astype(mx.int32)),
     r"k_pool dtype mlx.core.int32 is not uint32 \(the packed words of a quantized pool\)"),
    (PoolFormat(8, 32), _edit("v_scales", lambda a: a[:9]),
     r"k_pool 10x2x24 and v_scales 9x2x3 must have the same shape but for the last axis"),
    (PoolFormat(8, 32), _edit("k_biases", lambda a: a[None, None]),
     r"k_biases must be a slot-major \[pool_size, n_kv_heads, width\] \(3-D\) or head-major"),
]


@pytest.mark.parametrize("fmt, edit, message", BAD)
def test_bad_groups_name_the_array(fmt, edit, message):
    D = 96
    gs = fmt.group_size if fmt.group_size in (32, 64, 128) else 32
    pools = quant_pools((10,), 2, D, 8, gs)
    if edit is not None:
        pools = edit(pools)
    with pytest.raises(KernelArgumentError, match=message):
        check_pools("k", pools, 2, D, fmt)


def test_a_float_group_passed_for_a_quantized_format_is_refused():
    pools = dict(k_pool=mx.zeros((4, 2, 8)), v_pool=mx.zeros((4, 2, 8)))
    with pytest.raises(KernelArgumentError, match=r"pools k_pool, v_pool; the 8-bit, group size 32 format has "
                                                  r"k_pool, k_scales, k_biases, v_pool, v_scales, v_biases"):
        check_pools("k", pools, 2, 8, PoolFormat(8, 32))


@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_store_group_writes_mx_quantize_rows_at_valid_slots_only(lead):
    fmt = PoolFormat(4, 32)
    pools = quant_pools(lead, 2, 64, 4, 32, mx.float16)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float16))
    slots = mx.array([4, -1, 1], dtype=mx.int32)
    rows = group_rows(x, fmt)
    want = mx.quantize(x, group_size=32, bits=4)
    assert all(mx.array_equal(a, b).item() for a, b in zip(rows, want))
    got = store_group(tuple(pools[n] for n in fmt.names("k")), slots, rows)
    for member, w in zip(got, want):
        flat = member.reshape(-1, *member.shape[-2:]) if len(lead) == 1 else \
            member.transpose(0, 2, 1, 3).reshape(-1, *member.shape[1:2], member.shape[-1])
        assert mx.array_equal(flat[4], w[0]).item() and mx.array_equal(flat[1], w[2]).item()
        untouched = [i for i in range(6) if i not in (1, 4)]
        assert not mx.any(flat[mx.array(untouched)]).item()
