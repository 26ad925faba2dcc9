"""kv_quant_pool_store and rope_quant_pool_fused: the native kernels of the default device (CPU in CI,
the GPU on the GPU host) write mlx-lm's quantized pools (uint32 words, scales, biases) bit for bit
as mx.quantize does on that device and as the NumPy oracle (tests/_oracle.py, docs/kernel-abi.md's
rules for the backend) says, for 4 and 8 bits and group sizes 32, 64, 128, both pool layouts, every
float dtype, with ties and all-negative groups in the rows; q_out/k_out as the float RoPE kernels;
out-of-range slots; argument errors that leave the pools untouched."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelRegistry
from registry.core import backend_of
from registry.errors import KernelArgumentError
from registry.kernels._base import PoolFormat
from registry.kernels.kv_quant_pool_store import KvQuantPoolStoreKernel, kv_quant_pool_store
from registry.kernels.rope_quant_pool_fused import (QkNormRopeQuantKernel, RopeQuantKernel, rope_quant_pool_fused,
                                                    rope_quant_pool_fused_reference)
from registry.norm import NormConfig
from registry.rope import RopeConfig
from tests._oracle import by_slot, from_slots, quantize_numpy, rotate_numpy
from tests.rope_cases import MX_DTYPES, TOL, rope_variant, to_np

MANIFEST = KernelRegistry.from_yaml().manifest
FORMATS = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)]
LAYOUTS = {"slot-major": lambda S: (S,), "head-major": lambda S: (2, S // 2)}
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
GPU_RULES = backend_of(None) != "cpu"      # MLX's CUDA/Metal quantize: ties away from zero, max from 0


def native(cls, config, name):
    backend = backend_of(None)
    kernel = cls.build(MANIFEST.kernel(name), cls.context_for(config, backend))
    assert kernel.implementation == f"native-{backend}", kernel.reason
    return kernel


def native_store(fmt: PoolFormat) -> KvQuantPoolStoreKernel:
    return native(KvQuantPoolStoreKernel, fmt, "kv_quant_pool_store")


def native_rope(rope, norm, fmt: PoolFormat) -> RopeQuantKernel:
    return native(RopeQuantKernel if norm is None else QkNormRopeQuantKernel, (rope, norm, fmt), "rope_quant_pool_fused")


def tie_row(D: int, bits: int) -> np.ndarray:
    """A head row whose first group (any group size) quantizes with scale -1/64 and bias w_max = (n-1)/64,
    every other value at (w_max - x) * 64 = k + 0.5: a tie of every element (exact in bf16)."""
    n, s = (1 << bits) - 1, 2.0 ** -6
    x = (2 * (np.arange(D) % 14) + 1) * s / 2
    x[0], x[1] = -s, (n - 1) * s
    return x.astype(np.float32)


def rows(rng, shape, dtype, scale=1.0, bits=4):
    """Normal rows with the cases where the rounding rules part: head 0 of token 0 all negative, head 0
    of token 1 a row of ties (tie_row) for `bits`."""
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[0, 0] = -np.abs(x[0, 0]) - 0.25
    if shape[0] > 1:
        x[1, 0] = tie_row(shape[-1], bits)
    return mx.array(x).astype(MX_DTYPES[dtype])


def quant_pools(rng, lead, H, D, fmt, dtype):
    """Pools of random contents (untouched slots must keep them): per side words, scales, biases."""
    out = []
    for _ in "kv":
        for width, dt in zip(fmt.widths(D), (None, dtype, dtype)):
            shape = (*lead[:-1], H, lead[-1], width) if len(lead) == 2 else (*lead, H, width)
            if dt is None:
                out.append(mx.array(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)))
            else:
                out.append(mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[dt]))
    return out


def expected(pools, slots, k_rows, v_rows, fmt, gpu=GPU_RULES):
    """The pools after the store, from the oracle (gpu: MLX's CUDA/Metal rules, else its CPU's): (words,
    scales, biases) per side, the scales rounded once to their dtype; slots < 0 or >= the slot count
    untouched."""
    want = []
    for side, x in ((pools[:3], k_rows), (pools[3:], v_rows)):
        quant = quantize_numpy(to_np(x), fmt.group_size, fmt.bits, gpu)
        for member, new in zip(side, quant):
            old = raw(member)
            flat = by_slot(old).copy()
            if member.dtype != mx.uint32:
                new = to_np(mx.array(new).astype(member.dtype))
            for t, s in enumerate(np.asarray(slots)):
                if 0 <= s < flat.shape[0]:
                    flat[s] = new[t]
            want.append(from_slots(flat, old.shape))
    return want


def raw(a: mx.array) -> np.ndarray:
    """A pool array as NumPy: uint32 words as they are, floats as float32 (exact)."""
    return np.array(a) if a.dtype == mx.uint32 else to_np(a)


def assert_pools(got, want, names=("k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases")):
    for name, g, w in zip(names, got, want):
        np.testing.assert_array_equal(raw(g), w, err_msg=name)


def token_rows(x: mx.array) -> mx.array:
    return x if x.ndim == 3 else x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])


# ----------------------------------------------------------------------------- kv_quant_pool_store

def test_the_cases_part_the_backends_rules():
    """The rows the tests store hold groups where MLX's CPU and GPU rules give other words or scales:
    ties and an all-negative group (so the tests below would see a kernel with the other rules)."""
    for bits in (4, 8):
        x = rows(np.random.default_rng(0), (2, 1, 128), "bfloat16", bits=bits)
        cpu, gpu = (quantize_numpy(to_np(x), 32, bits, g) for g in (False, True))
        assert (cpu[0][1] != gpu[0][1]).any()                            # ties
        assert (cpu[1][0, 0, 0] != gpu[1][0, 0, 0]) and cpu[0][0].any()  # all negative: another scale


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bits, gs", FORMATS)
@pytest.mark.parametrize("dtype", list(MX_DTYPES))
def test_store_is_mx_quantize_bit_for_bit(native_artifacts, dtype, bits, gs, layout):
    rng = np.random.default_rng(bits * gs)
    fmt, T, H, D = PoolFormat(bits, gs), 5, 2, 128
    k, v = rows(rng, (T, H, D), dtype, bits=bits), rows(rng, (T, H, D), dtype, scale=30.0, bits=bits)
    slots = mx.array([3, 1, 0, 7, 5], dtype=mx.int32)
    pools = quant_pools(rng, LAYOUTS[layout](8), H, D, fmt, dtype)
    want = expected(pools, slots, k, v, fmt)
    got = native_store(fmt)(k, v, slots, *[mx.array(p) for p in pools])
    assert_pools(got, want)
    # mlx-lm's own quantization on this device: the reference path, mx.quantize
    assert_pools(KvQuantPoolStoreKernel(fmt, backend="cpu").reference(k, v, slots, *pools), want)


@pytest.mark.parametrize("L", [1, 3])
def test_store_reads_the_attentions_strided_views(native_artifacts, L):
    """k and v as the attention's [B, Hkv, L, D] views of one projection (transposed, sliced): read
    in place, token t = b * L + l, into mlx-lm's head-major buffers."""
    rng = np.random.default_rng(L)
    fmt, B, H, D = PoolFormat(8, 64), 2, 3, 64
    kv = rows(rng, (B * L, 2 * H, D), "bfloat16").reshape(B, L, 2 * H, D).transpose(0, 2, 1, 3)
    k, v = kv[:, :H], kv[:, H:]
    slots = mx.array([b * 8 + 2 + l for b in range(B) for l in range(L)], dtype=mx.int32)
    pools = quant_pools(rng, (B, 8), H, D, fmt, "bfloat16")
    want = expected(pools, slots, token_rows(k), token_rows(v), fmt)
    assert_pools(native_store(fmt)(k, v, slots, *[mx.array(p) for p in pools]), want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_store_never_writes_out_of_range_slots(native_artifacts, layout):
    rng = np.random.default_rng(4)
    fmt = PoolFormat(4, 32)
    slots = [9, 8, 10**6, INT32_MAX, -1, INT32_MIN, 0, 7]
    k, v = rows(rng, (8, 2, 64), "float16"), rows(rng, (8, 2, 64), "float16")
    pools = quant_pools(rng, LAYOUTS[layout](8), 2, 64, fmt, "float16")
    slots = mx.array(slots, dtype=mx.int32)
    got = native_store(fmt)(k, v, slots, *[mx.array(p) for p in pools], check_slots=False)
    assert_pools(got, expected(pools, slots, k, v, fmt))
    with pytest.raises(KernelArgumentError, match=r"slots\[0\]=9 is out of range for a pool of 8 slots"):
        native_store(fmt)(k, v, slots, *pools)


def _pools(fmt, D=64, S=4, H=2, dtype=mx.float16):
    return [mx.zeros((S, H, w), mx.uint32 if i % 3 == 0 else dtype) for i, w in enumerate(fmt.widths(D) * 2)]


BAD_STORE = [
    (dict(bits=3), r"kv_quant_pool_store: bits=3: the kernel stores 4- or 8-bit rows"),
    (dict(group_size=48), r"group_size=48 is not one of 32, 64, 128"),
    (dict(D=96, group_size=64), r"group_size=64 does not divide head_dim=96"),
    (dict(edits=[(1, lambda a: a[..., :1])]),
     r"k_scales 4x2x1: a slot-major pool must be \[pool_size, n_kv_heads=2, head_dim/32=2\]"),
    (dict(edits=[(5, lambda a: a.astype(mx.float32))]), r"v_biases dtype mlx.core.float32 differs from k_scales"),
    (dict(edits=[(i, lambda a: a.astype(mx.bfloat16)) for i in (1, 2, 4, 5)]),
     r"k_scales dtype mlx.core.bfloat16 differs from the activations' mlx.core.float16"),
    (dict(edits=[(3, lambda a: mx.zeros((*a.shape[:-1], a.shape[-1] * 2), mx.uint32))]),
     r"v_pool 4x2x32: a slot-major pool must be \[pool_size, n_kv_heads=2, head_dim\*8/32=16\]"),
    (dict(edits=[(0, lambda a: a.astype(mx.int32))]), r"k_pool dtype mlx.core.int32 is not uint32"),
]


@pytest.mark.parametrize("case, message", BAD_STORE)
def test_store_argument_errors_name_the_argument_and_write_nothing(native_artifacts, case, message):
    D = case.get("D", 64)
    bits, gs = case.get("bits", 8), case.get("group_size", 32)
    pools = _pools(PoolFormat(8, 32), D=D)
    for i, edit in case.get("edits", ()):
        pools[i] = edit(pools[i])
    before = [raw(p) for p in pools]
    k = mx.ones((2, 2, D), mx.float16)
    with pytest.raises(KernelArgumentError, match=message):
        kv_quant_pool_store(k, k, mx.array([0, 1], dtype=mx.int32), *pools, bits=bits, group_size=gs)
    for p, b in zip(pools, before):
        np.testing.assert_array_equal(raw(p), b)


def test_functional_entry_refuses_a_non_int_format():
    pools = _pools(PoolFormat(8, 32))
    with pytest.raises(KernelArgumentError, match=r"bits must be an int, got str '8'"):
        kv_quant_pool_store(mx.ones((1, 2, 64)), mx.ones((1, 2, 64)), mx.array([0], mx.int32), *pools, bits="8",
                            group_size=32)


# ----------------------------------------------------------------------------- rope_quant_pool_fused

ROPE_CASES = [
    ("float32", "full-base", None, (8, 64), "slot-major"),
    ("bfloat16", "partial-base-scaled", None, (4, 32), "head-major"),
    ("float16", "full-traditional-freqs", NormConfig(1e-6, 0.0), (4, 128), "slot-major"),
    ("bfloat16", "partial-traditional", NormConfig(1e-5, 1.0), (8, 32), "head-major"),
    ("float32", "partial-freqs-inf", NormConfig(1e-6, 0.0), (8, 128), "head-major"),
]


def rope_oracle(q, k, positions, rope, norm, wq, wk):
    """Float64 q/k norm (rounded once to the activations' dtype, as the model's norm returns it) and RoPE."""
    def normed(x, w):
        if norm is None:
            return to_np(x)
        x64 = to_np(x).astype(np.float64)
        y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + norm.eps) * (to_np(w) + norm.weight_offset)
        return to_np(mx.array(y.astype(np.float32)).astype(x.dtype))
    p = to_np(positions)
    return rotate_numpy(normed(q, wq), p, rope), rotate_numpy(normed(k, wk), p, rope)


@pytest.mark.parametrize("dtype, variant, norm, fmt, layout", ROPE_CASES)
def test_rope_quant_stores_mx_quantize_of_its_own_k_out(native_artifacts, dtype, variant, norm, fmt, layout):
    """q_out and k_out as the float kernels compute them (the oracle within their tolerance); the pools
    hold the oracle's quantization of exactly the k_out returned, and of v, bit for bit."""
    rng = np.random.default_rng(len(variant))
    fmt, T, Hq, Hkv, D = PoolFormat(*fmt), 6, 8, 2, 128
    rope = rope_variant(variant, D)
    q, k = rows(rng, (T, Hq, D), dtype, 3.0), rows(rng, (T, Hkv, D), dtype, 0.5)
    v = rows(rng, (T, Hkv, D), dtype, bits=fmt.bits)
    positions = mx.array(rng.integers(0, 5000, T).astype(np.int32))
    slots = mx.array([5, 6, 0, 7, 2, INT32_MAX], dtype=mx.int32)
    wq, wk = rows(rng, (1, 1, D), dtype, 0.5).reshape(D), rows(rng, (1, 1, D), dtype, 0.5).reshape(D)
    pools = quant_pools(rng, LAYOUTS[layout](8), Hkv, D, fmt, dtype)
    weights = () if norm is None else (wq, wk)
    kernel = native_rope(rope, norm, fmt)
    got = kernel(q, k, v, positions, slots, *[mx.array(p) for p in pools], *weights, check_slots=False)
    want_q, want_k = rope_oracle(q, k, positions, rope, norm, wq, wk)
    tol = TOL[dtype] * (1 if norm is None else 2)
    for name, g, w in (("q_out", got[0], want_q), ("k_out", got[1], want_k)):
        assert g.dtype == MX_DTYPES[dtype] and g.shape == w.shape, name
        np.testing.assert_allclose(to_np(g), w, atol=tol, rtol=tol, err_msg=name)
    assert_pools(got[2:], expected(pools, slots, got[1], v, fmt))
    ref = rope_quant_pool_fused_reference(q, k, v, positions, slots, *pools, rope=rope, bits=fmt.bits,
                                          group_size=fmt.group_size, norm=norm, **dict(zip(("q_weight", "k_weight"),
                                                                                           weights)))
    assert_pools(ref[2:], expected(pools, slots, ref[1], v, fmt))


@pytest.mark.parametrize("norm", [None, NormConfig(1e-6, 0.0)])
def test_rope_quant_decode_on_the_attentions_views(native_artifacts, norm):
    """A decode step as the drop-in cache makes it: q, k, v [B, H, 1, D] views of one projection, mlx-lm's
    head-major buffers; the kernel's q_out/k_out match the reference's, the pools the oracle's."""
    rng = np.random.default_rng(7)
    fmt, B, Hq, Hkv, D = PoolFormat(8, 64), 3, 4, 2, 64
    rope = RopeConfig(D, base=1e4)
    qkv = rows(rng, (B, Hq + 2 * Hkv, D), "float16").reshape(B, 1, Hq + 2 * Hkv, D).transpose(0, 2, 1, 3)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    positions = mx.array([4, 9, 0], dtype=mx.int32)
    slots = mx.array([0 * 16 + 4, 1 * 16 + 9, 2 * 16 + 0], dtype=mx.int32)
    pools = quant_pools(rng, (B, 16), Hkv, D, fmt, "float16")
    w = (mx.ones((D,), mx.float16), mx.full((D,), 0.5, mx.float16)) if norm is not None else ()
    got = native_rope(rope, norm, fmt)(q, k, v, positions, slots, *[mx.array(p) for p in pools], *w)
    ref = rope_quant_pool_fused(q, k, v, positions, slots, *pools, rope=rope, bits=8, group_size=64, norm=norm,
                                **dict(zip(("q_weight", "k_weight"), w)))
    assert got[0].shape == q.shape and got[1].shape == k.shape
    for g, r in zip(got[:2], ref[:2]):
        np.testing.assert_allclose(to_np(g), to_np(r), atol=TOL["float16"], rtol=TOL["float16"])
    assert_pools(got[2:], expected(pools, slots, token_rows(got[1]), token_rows(v), fmt))


def test_rope_quant_kernel_set_has_the_norm_form_when_the_context_has_a_norm():
    from registry.core import SelectionContext

    ctx = SelectionContext(attention="mha", rope=RopeConfig(64), rope_error="", n_heads=4, n_kv_heads=2, head_dim=64,
                           dtype="float16", backend="cpu", qk_norm=NormConfig(1e-6, 1.0), qk_norm_error="")
    kset = KernelRegistry.from_yaml().build_for_context(ctx.quantized(4, 32))
    assert isinstance(kset.rope_quant, RopeQuantKernel) and kset.rope is None and kset.kv_store is None
    assert isinstance(kset.rope_quant.norm, QkNormRopeQuantKernel) and kset.kv_store_quant is not None
    assert kset.rope_quant.norm.fmt == PoolFormat(4, 32) and kset.rope_quant.norm.norm_config.weight_offset == 1.0
    assert kset.rope_quant.norm._launcher is kset.rope_quant._launcher
    bad = KernelRegistry.from_yaml().build_for_context(ctx.quantized(8, 128))
    assert bad.rope_quant is None
    assert bad.rejections["rope_quant_pool_fused"].startswith("head_dim=64: the kernel needs an even multiple of the "
                                                              "group size 128")
    mixed = KernelRegistry.from_yaml().build_for_context(ctx.quantized(8, 32, mx.float32))
    assert mixed.rejections["kv_quant_pool_store"] == ("scales in float32 for float16 activations: mlx-lm keeps them "
                                                       "in the keys' dtype")


def test_rope_quant_argument_errors():
    fmt = PoolFormat(4, 64)
    pools = _pools(fmt, D=64)
    q, k = mx.ones((2, 4, 64), mx.float16), mx.ones((2, 2, 64), mx.float16)
    pos = slots = mx.array([0, 1], dtype=mx.int32)
    with pytest.raises(KernelArgumentError, match=r"rope_quant_pool_fused: k_scales 4x2x2: a slot-major pool must "
                                                  r"be \[pool_size, n_kv_heads=2, head_dim/64=1\]"):
        rope_quant_pool_fused(q, k, k, pos, slots, *_pools(PoolFormat(4, 32), D=64), rope=RopeConfig(64), bits=4,
                              group_size=64)
    with pytest.raises(KernelArgumentError, match=r"q_weight must be a float \[head_dim=64\] array"):
        rope_quant_pool_fused(q, k, k, pos, slots, *pools, rope=RopeConfig(64), bits=4, group_size=64,
                              norm=NormConfig(1e-6, 0.0), q_weight=mx.ones((32,)), k_weight=mx.ones((64,)))
    with pytest.raises(KernelArgumentError, match=r"norm must be a registry.norm.NormConfig or None, got str"):
        rope_quant_pool_fused(q, k, k, pos, slots, *pools, rope=RopeConfig(64), bits=4, group_size=64, norm="rms")


def test_the_rows_per_threadgroup_have_one_source():
    """The wrappers' ROWS_PER_GROUP is what the CUDA kernels check blockDim against and the Metal
    kernels size their threadgroup arrays for."""
    import re

    from registry.kernels.kv_quant_pool_store import ROWS_PER_GROUP, quant_geometry
    from registry.paths import PROJECT_ROOT

    cuh = (PROJECT_ROOT / "cuda_src" / "aot_quant.cuh").read_text()
    assert int(re.search(r"kQuantRowsPerBlock = (\d+);", cuh).group(1)) == ROWS_PER_GROUP
    for name in ("kv_quant_pool_store", "rope_quant_pool_fused"):
        metal = (PROJECT_ROOT / "metal_src" / f"{name}.metal").read_text()
        assert f"threadgroup float staged[{ROWS_PER_GROUP} * 512];" in metal, name
    assert quant_geometry("cuda", 3) == ((96, 1, 1), (32 * ROWS_PER_GROUP, 1, 1))
    assert quant_geometry("metal", 20) == ((32, 20, 1), (32, ROWS_PER_GROUP, 1))
