"""decode_attention_quantized: the native kernel of the default device (CPU in CI, the GPU on the GPU
host) over mlx-lm's quantized pools, against decode_attention's NumPy oracle on the pools'
dequantized values (the kernel's fp32 q * scale + bias), against decode_attention over mx.dequantize's
pools (the documented tolerance: that dequantization rounds each value to the scales' dtype), and
against the reference: head-major caches with left padding and ring order, slot-major pools through a
table, GQA, L <= 8, windows, soft-capping, rows long enough to split on CUDA; 4 and 8 bits, group sizes
32, 64, 128; argument errors that name the argument."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelRegistry
from registry.core import backend_of
from registry.errors import KernelArgumentError
from registry.kernels._base import PoolFormat
from registry.kernels.decode_attention import cuda_slots, decode_attention_reference, split_plan
from registry.kernels.decode_attention_quantized import (DecodeAttentionQuantizedKernel, decode_attention_quantized,
                                                         decode_attention_quantized_reference)
from tests.test_decode_attention import DTYPES, oracle

SPEC = KernelRegistry.from_yaml().manifest.kernel("decode_attention_quantized")
TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
# Against decode_attention over mx.dequantize's pools: those values are rounded once more to the scales'
# dtype (half an ulp of it, relative), which moves each score by up to about that times |q| |k| and the
# softmax carries to the outputs (measured: up to 3.6e-2 in bfloat16, 4-bit, head_dim 128). The
# documented tolerance (docs/kernel-abi.md): float32 1e-4, float16 8e-3, bfloat16 6e-2.
TOL_DEQUANTIZED = {mx.float32: 1e-4, mx.float16: 8e-3, mx.bfloat16: 6e-2}
# The kernel against the fp32 oracle: CUDA's tensor-core path (2-byte types, head_dim 64 or 128) rounds
# the dequantized rows to the dtype before its mma, as mx.dequantize does, so 2-byte types get the
# documented tolerance; float32 (and the fp32 CPU and Metal paths) the oracle's.
KERNEL_TOL = {mx.float32: TOL[mx.float32], mx.float16: TOL_DEQUANTIZED[mx.float16],
              mx.bfloat16: TOL_DEQUANTIZED[mx.bfloat16]}


def native_kernel(fmt: PoolFormat) -> DecodeAttentionQuantizedKernel:
    backend = backend_of(None)
    kernel = DecodeAttentionQuantizedKernel.build(SPEC, DecodeAttentionQuantizedKernel.context_for(fmt, backend))
    assert kernel.implementation == f"native-{backend}", kernel.reason
    return kernel


def arr(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def quantized(x: mx.array, fmt: PoolFormat) -> tuple:
    return tuple(mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits))


def fp32(pool: tuple, fmt: PoolFormat) -> mx.array:
    """The kernel's values of a pool: q * scale + bias in fp32."""
    w, s, b = pool
    return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=fmt.group_size, bits=fmt.bits)


def check(got, want, dtype, tol=TOL):
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got.astype(mx.float32)), want, atol=tol[dtype], rtol=tol[dtype])


CASES = [  # B, Hq, Hkv, L, D, S, window, softcap, bits, group size
    (1, 4, 4, 1, 64, 17, 0, 0.0, 8, 64),         # MHA, one row
    (3, 8, 2, 1, 128, 40, 0, 0.0, 4, 32),        # GQA, left padding
    (2, 8, 1, 3, 64, 33, 0, 0.0, 8, 32),         # MQA, three queries, causal among them
    (2, 16, 2, 8, 128, 50, 7, 0.0, 4, 128),      # L = 8, sliding window
    (2, 4, 2, 2, 256, 30, 0, 30.0, 8, 128),      # head_dim 256, soft-capping
    (1, 12, 4, 1, 96, 9, 3, 0.0, 4, 32),         # head_dim 96 (lanes past the row)
    (2, 16, 4, 4, 128, 45, 5, 0.0, 8, 64),       # 16 query rows a kv head: two tensor-core passes
    (2, 8, 2, 2, 64, 30, 0, 20.0, 4, 64),        # head_dim 64, 4 bits, soft-capping
]


@DTYPES
@pytest.mark.parametrize("B,Hq,Hkv,L,D,S,window,softcap,bits,gs", CASES)
def test_head_major_matches_oracle_reference_and_dequantized(native_artifacts, dtype, B, Hq, Hkv, L, D, S, window,
                                                             softcap, bits, gs):
    rng = np.random.default_rng(D + L)
    fmt = PoolFormat(bits, gs)
    q = arr(rng, (B, L, Hq, D), dtype).transpose(0, 2, 1, 3) if B > 1 else arr(rng, (B, Hq, L, D), dtype)
    kp, vp = quantized(arr(rng, (B, Hkv, S, D), dtype), fmt), quantized(arr(rng, (B, Hkv, S, D), dtype, 2.0), fmt)
    lens = mx.array(rng.integers(L, S + 1, B).astype(np.int32))
    scale = D ** -0.5
    want = oracle(q, fp32(kp, fmt), fp32(vp, fmt), lens, lens, None, scale, window, softcap)
    got = native_kernel(fmt)(q, kp, vp, lens, lens, scale=scale, window=window, softcap=softcap)
    check(got, want, dtype, KERNEL_TOL)
    with mx.stream(mx.cpu):              # exact f32 on the CPU stream (a GPU matmul may round through TF32)
        check(decode_attention_quantized_reference(q, kp, vp, lens, bits=bits, group_size=gs, scale=scale,
                                                   window=window, softcap=softcap), want, dtype)
        # attention over the cache as mx.dequantize gives it (rounded to the scales' dtype)
        deq = [mx.dequantize(*p, group_size=gs, bits=bits) for p in (kp, vp)]
        plain = decode_attention_reference(q, *deq, lens, lens, scale=scale, window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got.astype(mx.float32)), np.asarray(plain.astype(mx.float32)),
                               atol=TOL_DEQUANTIZED[dtype], rtol=TOL_DEQUANTIZED[dtype])


@DTYPES
@pytest.mark.parametrize("bits", [8, 4])
def test_ring_order_and_slot_table(native_artifacts, dtype, bits):
    """A ring (kv_end wrapping the valid rows around the buffer) and a slot-major pool read through a
    table whose padding entries (-1, past the pool) are never read."""
    rng = np.random.default_rng(3)
    fmt = PoolFormat(bits, 64)
    q = arr(rng, (3, 8, 1, 64), dtype)
    kp, vp = quantized(arr(rng, (3, 2, 24, 64), dtype), fmt), quantized(arr(rng, (3, 2, 24, 64), dtype), fmt)
    kv_len, kv_end = mx.array([24, 20, 5], dtype=mx.int32), mx.array([7, 3, 24], dtype=mx.int32)
    want = oracle(q, fp32(kp, fmt), fp32(vp, fmt), kv_len, kv_end, None, 0.125)
    check(native_kernel(fmt)(q, kp, vp, kv_len, kv_end, scale=0.125), want, dtype, KERNEL_TOL)
    P, M = 64, 20
    pool_k, pool_v = quantized(arr(rng, (P, 2, 64), dtype), fmt), quantized(arr(rng, (P, 2, 64), dtype), fmt)
    table = rng.permutation(P)[:3 * M].reshape(3, M).astype(np.int32)
    table[1, 15:] = -1
    table[2, 3:] = 10**6
    lens = mx.array([20, 15, 3], dtype=mx.int32)
    want = oracle(q, fp32(pool_k, fmt), fp32(pool_v, fmt), lens, lens, table, 0.2)
    check(native_kernel(fmt)(q, pool_k, pool_v, lens, None, mx.array(table), scale=0.2), want, dtype, KERNEL_TOL)


@DTYPES
@pytest.mark.parametrize("S,B,bits", [(3000, 1, 4), (1100, 2, 8)])
def test_long_rows_split(native_artifacts, S, B, bits, dtype):
    """Rows long enough that CUDA splits them across blocks (flash-decoding); one split elsewhere."""
    rng = np.random.default_rng(5)
    fmt = PoolFormat(bits, 64)
    q = arr(rng, (B, 8, 1, 128), dtype)
    kp, vp = quantized(arr(rng, (B, 2, S, 128), dtype), fmt), quantized(arr(rng, (B, 2, S, 128), dtype), fmt)
    lens = mx.array([S - 7, S // 2][:B], dtype=mx.int32)
    assert split_plan(S, B, 2, backend_of(None), cuda_slots(dtype))[0] > 1 or backend_of(None) != "cuda"
    want = oracle(q, fp32(kp, fmt), fp32(vp, fmt), lens, lens, None, 0.088)
    kernel = native_kernel(fmt)
    for _ in range(2):                       # the locks are back to zero after a launch: a second agrees
        check(kernel(q, kp, vp, lens, lens, scale=0.088), want, dtype, KERNEL_TOL)


def test_functional_entry(native_artifacts):
    rng = np.random.default_rng(1)
    fmt = PoolFormat(4, 64)
    q = arr(rng, (2, 8, 1, 64), mx.float16)
    kp, vp = quantized(arr(rng, (2, 2, 12, 64), mx.float16), fmt), quantized(arr(rng, (2, 2, 12, 64), mx.float16), fmt)
    lens = mx.array([12, 5], dtype=mx.int32)
    want = oracle(q, fp32(kp, fmt), fp32(vp, fmt), lens, lens, None, 0.3)
    check(decode_attention_quantized(q, kp, vp, lens, bits=4, group_size=64, scale=0.3), want, mx.float16, KERNEL_TOL)


def _case(D=64, bits=8, gs=64, dtype=mx.float32):
    rng = np.random.default_rng(0)
    fmt = PoolFormat(bits, gs)
    q = arr(rng, (2, 8, 1, D), dtype)
    return q, quantized(arr(rng, (2, 2, 12, D), dtype), fmt), quantized(arr(rng, (2, 2, 12, D), dtype), fmt), \
        mx.array([12, 3], dtype=mx.int32)


@pytest.mark.parametrize("edit, fmt, message", [
    (None, PoolFormat(3, 64), r"decode_attention_quantized: bits=3: the kernel stores 4- or 8-bit rows"),
    (None, PoolFormat(8, 48), r"group_size=48 is not one of 32, 64, 128"),
    (lambda q, k, v, n: (arr(np.random.default_rng(0), (2, 8, 1, 96), mx.float32), k, v, n), PoolFormat(8, 64),
     r"group_size=64 does not divide head_dim=96"),
    (lambda q, k, v, n: (q, (k[0], k[1][..., :1], k[2]), v, n), PoolFormat(8, 32),
     r"k_scales 2x2x12x1: a head-major pool must be \[batch, n_kv_heads=2, rows, head_dim/32=2\]"),
    (lambda q, k, v, n: (q, k, (v[0], v[1], v[2].astype(mx.float16)), n), PoolFormat(8, 64),
     r"v_biases dtype mlx.core.float16 differs from k_scales dtype mlx.core.float32"),
    (lambda q, k, v, n: (q, tuple(a.astype(mx.bfloat16) if i else a for i, a in enumerate(k)),
                         tuple(a.astype(mx.bfloat16) if i else a for i, a in enumerate(v)), n), PoolFormat(8, 64),
     r"k_scales dtype mlx.core.bfloat16 differs from the activations' mlx.core.float32"),
    (lambda q, k, v, n: (q, (k[0][..., :8], k[1], k[2]), v, n), PoolFormat(8, 64),
     r"k_pool 2x2x12x8: a head-major pool must be \[batch, n_kv_heads=2, rows, head_dim\*8/32=16\]"),
    (lambda q, k, v, n: (q, k[:2], v, n), PoolFormat(8, 64),
     r"k_pool must be a quantized pool group \(words, scales, biases\), got tuple of 2"),
    (lambda q, k, v, n: (q, k, v, mx.array([13, 1], dtype=mx.int32)), PoolFormat(8, 64),
     r"decode_attention_quantized: kv_len\[0\]=13 is outside \[0, 12\]"),
])
def test_argument_errors_name_the_argument(native_artifacts, edit, fmt, message):
    q, k, v, n = _case(gs=64 if fmt.group_size not in (32, 128) else fmt.group_size)
    if edit is not None:
        q, k, v, n = edit(q, k, v, n)
    with pytest.raises(KernelArgumentError, match=message):
        decode_attention_quantized(q, k, v, n, bits=fmt.bits, group_size=fmt.group_size, scale=0.1)
    if fmt.bits in (4, 8) and fmt.group_size in (32, 64, 128):
        with pytest.raises(KernelArgumentError, match=message):
            native_kernel(fmt)(q, k, v, n, scale=0.1)


def test_selected_for_quantized_caches_only():
    from registry.core import SelectionContext
    from registry.rope import RopeConfig

    ctx = SelectionContext(attention="mha", rope=RopeConfig(64), rope_error="", n_heads=8, n_kv_heads=2, head_dim=64,
                           dtype="bfloat16", backend="cpu")
    reg = KernelRegistry.from_yaml()
    assert reg.build_for_context(ctx).attention_quant is None
    kset = reg.build_for_context(ctx.quantized(4, 64))
    assert isinstance(kset.attention_quant, DecodeAttentionQuantizedKernel) and kset.attention is None
    assert kset.attention_quant.fmt == PoolFormat(4, 64)
    assert kset.rejections["decode_attention"] == "the KV cache is quantized (4-bit): the kernel reads float rows"
