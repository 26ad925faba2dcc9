"""decode_attention: the native kernel of the default device (CPU in CI, the GPU on the GPU host) and
the reference against a NumPy oracle written from docs/kernel-abi.md: head-major caches (left
padding, ring order), slot-major pools through a table, GQA, L <= 8 with the causal mask among the
queries, sliding windows, soft-capping, rows long enough to split on CUDA; argument errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelRegistry
from registry.core import backend_of
from registry.errors import KernelArgumentError
from registry.kernels.decode_attention import (DecodeAttentionKernel, decode_attention, decode_attention_reference,
                                               split_plan, cuda_slots)

SPEC = KernelRegistry.from_yaml().manifest.kernel("decode_attention")
TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def native_kernel() -> DecodeAttentionKernel:
    backend = backend_of(None)
    kernel = DecodeAttentionKernel.build(SPEC, DecodeAttentionKernel.context_for(None, backend))
    assert kernel.implementation == f"native-{backend}", kernel.reason
    return kernel


def oracle(q, kp, vp, kv_len, kv_end, table, scale, window=0, softcap=0.0):
    """float64, one query row at a time, straight from the contract."""
    q, kp, vp = (np.asarray(x.astype(mx.float32), np.float64) for x in (q, kp, vp))
    kv_len, kv_end = np.asarray(kv_len), np.asarray(kv_end)
    B, Hq, L, D = q.shape
    head_major = kp.ndim == 4
    Hkv = kp.shape[1]
    rows = kp.shape[2] if head_major else np.asarray(table).shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        n = min(max(int(kv_len[b]), 0), rows)
        for hq in range(Hq):
            hk = hq // (Hq // Hkv)
            for t in range(L):
                hi = n - L + t
                s, vs = [], []
                for i in range(n):
                    if i > hi or (window > 0 and i <= hi - window):
                        continue
                    if head_major:
                        p = (int(kv_end[b]) - n + i) % rows
                        key, val = kp[b, hk, p], vp[b, hk, p]
                    else:
                        slot = int(np.asarray(table)[b, i])
                        if not 0 <= slot < kp.shape[0]:
                            continue
                        key, val = kp[slot, hk], vp[slot, hk]
                    x = float(q[b, hq, t] @ key) * scale
                    s.append(softcap * np.tanh(x / softcap) if softcap > 0 else x)
                    vs.append(val)
                if s:
                    w = np.exp(np.array(s) - max(s))
                    out[b, hq, t] = (w / w.sum()) @ np.array(vs)
    return out


def arr(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def head_major_case(B, Hq, Hkv, L, D, S, dtype, seed=0, lens=None, ends=None, strided_q=False):
    rng = np.random.default_rng(seed)
    if strided_q:        # the attention's q: a transposed view of [B, L, Hq, D]
        q = arr(rng, (B, L, Hq, D), dtype).transpose(0, 2, 1, 3)
    else:
        q = arr(rng, (B, Hq, L, D), dtype)
    kp, vp = arr(rng, (B, Hkv, S, D), dtype), arr(rng, (B, Hkv, S, D), dtype)
    lens = rng.integers(L, S + 1, B) if lens is None else lens
    ends = lens if ends is None else ends
    return q, kp, vp, mx.array(np.asarray(lens, np.int32)), mx.array(np.asarray(ends, np.int32))


def check(got, want, dtype):
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got.astype(mx.float32)), want, atol=TOL[dtype], rtol=TOL[dtype])


CASES = [  # B, Hq, Hkv, L, D, S, window, softcap
    (1, 4, 4, 1, 64, 17, 0, 0.0),          # MHA, one row
    (3, 8, 2, 1, 128, 40, 0, 0.0),         # GQA, left padding
    (2, 8, 1, 3, 64, 33, 0, 0.0),          # MQA, three queries, causal among them
    (2, 16, 2, 8, 96, 50, 7, 0.0),         # L = 8, sliding window
    (2, 4, 2, 2, 256, 30, 0, 30.0),        # head_dim 256, soft-capping
    (1, 12, 4, 1, 80, 9, 3, 0.0),          # head_dim 80 (lanes per key not a power of two's multiple)
    (2, 16, 4, 4, 128, 45, 5, 0.0),        # 16 query rows a kv head: two passes of the tensor-core path
    (2, 8, 2, 2, 64, 30, 0, 20.0),         # head_dim 64 (tensor cores for 2-byte types), soft-capping
]
DTYPES = pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=lambda d: str(d).split(".")[-1])


@DTYPES
@pytest.mark.parametrize("B,Hq,Hkv,L,D,S,window,softcap", CASES)
def test_head_major_matches_oracle_and_reference(native_artifacts, dtype, B, Hq, Hkv, L, D, S, window, softcap):
    q, kp, vp, kv_len, kv_end = head_major_case(B, Hq, Hkv, L, D, S, dtype, strided_q=B > 1)
    scale = D ** -0.5
    want = oracle(q, kp, vp, kv_len, kv_end, None, scale, window, softcap)
    check(native_kernel()(q, kp, vp, kv_len, kv_end, scale=scale, window=window, softcap=softcap), want, dtype)
    with mx.stream(mx.cpu):              # the oracle's twin: exact f32 (a GPU matmul may round through TF32)
        check(decode_attention_reference(q, kp, vp, kv_len, kv_end, scale=scale, window=window, softcap=softcap),
              want, dtype)


@DTYPES
def test_ring_order(native_artifacts, dtype):
    """A rotating cache: the newest row at kv_end - 1, the valid rows wrapping around the buffer."""
    q, kp, vp, _, _ = head_major_case(3, 8, 2, 1, 64, 24, dtype)
    kv_len, kv_end = mx.array([24, 20, 5], dtype=mx.int32), mx.array([7, 3, 24], dtype=mx.int32)
    want = oracle(q, kp, vp, kv_len, kv_end, None, 0.125)
    check(native_kernel()(q, kp, vp, kv_len, kv_end, scale=0.125), want, dtype)


@DTYPES
@pytest.mark.parametrize("L", [1, 4])
def test_slot_major_table(native_artifacts, L, dtype):
    rng = np.random.default_rng(3)
    B, Hq, Hkv, D, P, M = 3, 8, 2, 64, 64, 20
    q, kp, vp = arr(rng, (B, Hq, L, D), dtype), arr(rng, (P, Hkv, D), dtype), arr(rng, (P, Hkv, D), dtype)
    table = rng.permutation(P)[:B * M].reshape(B, M).astype(np.int32)
    table[1, 15:] = -1                       # past row 1's length: padding, never read
    kv_len = mx.array([20, 15, L], dtype=mx.int32)
    want = oracle(q, kp, vp, kv_len, kv_len, table, 0.2)
    check(native_kernel()(q, kp, vp, kv_len, None, mx.array(table), scale=0.2), want, dtype)


@DTYPES
@pytest.mark.parametrize("S,B", [(3000, 1), (1100, 2)])
def test_long_rows_split(native_artifacts, S, B, dtype):
    """Rows long enough that CUDA splits them across blocks (flash-decoding); one split elsewhere."""
    q, kp, vp, kv_len, kv_end = head_major_case(B, 8, 2, 1, 128, S, dtype, seed=5, lens=[S - 7, S // 2][:B])
    backend = backend_of(None)
    assert split_plan(S, B, 2, backend, cuda_slots(dtype))[0] > 1 or backend != "cuda"
    want = oracle(q, kp, vp, kv_len, kv_end, None, 0.088)
    kernel = native_kernel()
    for _ in range(2):                       # the locks are back to zero after a launch: a second agrees
        check(kernel(q, kp, vp, kv_len, kv_end, scale=0.088), want, dtype)


def test_empty_rows_give_zero(native_artifacts):
    q, kp, vp, _, _ = head_major_case(2, 4, 2, 1, 64, 8, mx.float32)
    kv_len = mx.array([0, 8], dtype=mx.int32)
    got = np.asarray(native_kernel()(q, kp, vp, kv_len, kv_len, scale=1.0))
    assert not got[0].any() and np.isfinite(got).all()


def test_functional_entry(native_artifacts):
    q, kp, vp, kv_len, kv_end = head_major_case(2, 8, 2, 1, 64, 12, mx.float32)
    want = oracle(q, kp, vp, kv_len, kv_end, None, 0.3)
    check(decode_attention(q, kp, vp, kv_len, kv_end, scale=0.3), want, mx.float32)


def bad(match, **kw):
    q, kp, vp, kv_len, kv_end = head_major_case(2, 8, 2, 1, 64, 12, mx.float32)
    args = dict(q=q, k_pool=kp, v_pool=vp, kv_len=kv_len, kv_end=kv_end, table=None)
    args.update(kw)
    scale = args.pop("scale", 0.1)
    with pytest.raises(KernelArgumentError, match=match):
        native_kernel()(*args.values(), scale=scale)


def test_argument_errors(native_artifacts):
    rng = np.random.default_rng(0)
    bad("q must be 4-D", q=arr(rng, (2, 8, 64), mx.float32))
    bad("q dtype", q=mx.zeros((2, 8, 1, 64), dtype=mx.int32))
    bad("L=9 query tokens", q=arr(rng, (2, 8, 9, 64), mx.float32))
    bad("k_pool dtype", k_pool=mx.zeros((2, 2, 12, 64), dtype=mx.float16))
    bad("not a multiple of n_kv_heads", q=arr(rng, (2, 7, 1, 64), mx.float32))
    bad("kv_len must be int32", kv_len=mx.array([3, 4, 5], dtype=mx.int32))
    bad(r"kv_len\[1\]=-1 is outside", kv_len=mx.array([3, -1], dtype=mx.int32))
    bad(r"kv_len\[0\]=13 is outside", kv_len=mx.array([13, 1], dtype=mx.int32))
    bad(r"kv_end\[1\]=99 is outside", kv_end=mx.array([3, 99], dtype=mx.int32))
    bad("scale must be a finite number", scale=float("nan"))
    bad("table must be None", table=mx.zeros((2, 12), dtype=mx.int32))
    pool = arr(rng, (10, 2, 64), mx.float32)
    bad("needs table", k_pool=pool, v_pool=pool)
    bad(r"table\[1, 2\]=10 points outside the pool of 10 slots", k_pool=pool, v_pool=pool,
        kv_len=mx.array([3, 3], dtype=mx.int32), table=mx.array([[0, 1, 2], [3, 4, 10]], dtype=mx.int32))


def test_split_plan():
    """Whole waves of the resident blocks (float32: 3 per SM x 132 SMs), the fewest splits within 3% of the
    best."""
    assert split_plan(200, 1, 8, "cuda") == (1, 200)
    for rows, batch in ((16640, 1), (16640, 4), (16640, 8), (16640, 32), (33024, 4), (2304, 32)):
        n, length = split_plan(rows, batch, 8, "cuda")
        blocks = batch * 8 * n
        assert n * length >= rows > (n - 1) * length and length >= 256, (rows, batch, n, length)
        assert blocks / (-(-blocks // 396) * 396) > 0.9, (rows, batch, n)
    assert split_plan(16640, 1, 8, "cuda")[0] == 48 and split_plan(16640, 32, 8, "cuda")[0] == 3
    assert split_plan(32768, 1, 8, "cpu") == (1, 32768)
    # 2-byte types: 2 blocks per SM (264 slots): one row of 8 kv heads fills a wave with 33 splits
    assert cuda_slots(mx.bfloat16) == 264 and cuda_slots(mx.float32) == 396
    assert split_plan(16640, 1, 8, "cuda", cuda_slots(mx.float16))[0] == 33


@pytest.mark.parametrize("extra,head_dim,want", [
    ({"sinks": mx.zeros((8,))}, 64, "the attention has sinks"),
    ({"alibi_slopes": mx.zeros((8,))}, 64, "ALiBi position biases"),
    ({"kv_lora_rank": 512}, 64, "not latent caches"),
    ({}, 72 + 4, "head_dim=76: the kernel reads rows of a multiple of 8"),
    ({}, 320, "head_dim=320"),
])
def test_configurations_it_cannot_serve_say_why(monkeypatch, extra, head_dim, want):
    """Selected on nothing it cannot compute, whatever `prefer` says (the flag forces speed, not
    correctness): each rejection names the reason."""
    from types import SimpleNamespace

    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION", "1")
    attn = SimpleNamespace(n_heads=8, **extra)
    ks = KernelRegistry.from_yaml().build_kernel_set(sample_attn=attn, n_kv_heads=2, head_dim=head_dim,
                                                     dtype=mx.bfloat16)
    assert ks.attention is None and want in ks.rejections["decode_attention"], ks.rejections


def test_selected_where_it_can_serve(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION", "1")
    ks = KernelRegistry.from_yaml().build_kernel_set(sample_attn=SimpleNamespace(n_heads=8), n_kv_heads=2,
                                                     head_dim=128, dtype=mx.bfloat16)
    assert "decode_attention" not in ks.rejections and ks.attention is not None
