"""The Metal sources of kv_pool_store, qk_norm_rope_pool_fused and the quantized stores
(kv_quant_pool_store, rope_quant_pool_fused) on the CPU through tests/metal_emu/ (sanitized runner,
exact-size buffers, shuffled thread order), driven through their real wrappers on an emulated 'metal'
backend and compared with the reference path (the quantized ones with the NumPy oracle of MLX's Metal
quantize, bit for bit); out-of-range slots under the sanitizers, and a mutant per kernel that proves
the bounds tests can fail. Strided activations for
all three kernels: [B, H, L, D] views (transposed, sliced, inner-strided, reversed) bound as they lie,
against the same kernel on contiguous token-major rows (bit for bit) and the reference path.
(rope_pool_fused's other emulation tests: tests/test_metal_emulation.py.)"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from registry.kernels._base import to_rows
from registry.kernels.kv_pool_store import KvPoolStoreKernel
from registry.kernels.rope_pool_fused import RopePoolFusedKernel
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT
from tests.metal_emu.emulator import EmulatedMetal, SanitizerError, compile_kernel, compile_source
from tests.test_metal_emulation import mutated
from tests.rope_cases import MX_DTYPES, TOL, to_np
from tests.test_kv_pool_store import LAYOUTS, case, check

MANIFEST = load_manifest()
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31


@pytest.fixture(scope="session")
def emu_cache(request, tmp_path_factory) -> Path:
    try:
        return Path(request.config.cache.mkdir("metal_emu"))
    except AttributeError:  # -p no:cacheprovider
        return tmp_path_factory.mktemp("metal_emu")


def emulated(cls, lib, name, config=None, order="shuffled", seed=0):
    spec = MANIFEST.kernel(name)
    kernel = cls(config, backend="metal", launcher=EmulatedMetal(lib, spec, order=order, seed=seed).launcher(),
                 reason="emulated")
    assert kernel.implementation == "native-metal"
    return kernel


# ----------------------------------------------------------------------------- kv_pool_store

KV_SOURCE = PROJECT_ROOT / "metal_src" / "kv_pool_store.metal"


@pytest.fixture(scope="module")
def kv_lib(emu_cache):
    return compile_kernel(MANIFEST.kernel("kv_pool_store"), emu_cache)


@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_pool_store_parity(kv_lib, dtype, layout):
    args = case(6, 2, 40, LAYOUTS[layout], dtype, dtype, [4, -1, 0, 8, 5, 2], seed=3)
    check(emulated(KvPoolStoreKernel, kv_lib, "kv_pool_store")(*args), args)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_pool_store_out_of_range_slots_never_write(kv_lib, layout):
    """Slots >= pool size up to INT32_MAX and < 0 down to INT32_MIN, unchecked, every buffer at its
    exact size under AddressSanitizer: only the valid rows change."""
    slots = [9, 10, 10**6, INT32_MAX, -1, INT32_MIN, 0, 8]
    args = case(len(slots), 2, 24, LAYOUTS[layout][:-1] + (24,), "float16", "float16", slots)
    check(emulated(KvPoolStoreKernel, kv_lib, "kv_pool_store")(*args, check_slots=False), args)


def test_kv_pool_store_sanitizer_catches_a_missing_bound(emu_cache):
    lib = compile_source(mutated(emu_cache, "slot < 0 || slot >= pool_size", "slot < 0", source=KV_SOURCE), emu_cache,
                         include_dirs=[KV_SOURCE.parent])
    args = case(2, 2, 8, (4, 2, 8), "float32", "float32", [4, 0])
    with pytest.raises(SanitizerError, match=r"WRITE of 4 bytes at byte -?\d+ of buffer\([23]\) [kv]_pool"):
        emulated(KvPoolStoreKernel, lib, "kv_pool_store")(*args, check_slots=False)


# ----------------------------------------------------------------------------- qk_norm_rope_pool_fused

QKN_SOURCE = PROJECT_ROOT / "metal_src" / "qk_norm_rope_pool_fused.metal"


@pytest.fixture(scope="module")
def qkn_lib(emu_cache):
    return compile_kernel(MANIFEST.kernel("qk_norm_rope_pool_fused"), emu_cache)


def qkn(lib, rope, norm, **kw):
    from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
    return emulated(QkNormRopePoolFusedKernel, lib, "qk_norm_rope_pool_fused", (rope, norm), **kw)


@pytest.mark.parametrize("dtype, variant, head_dim, layout", [
    ("float32", "full-base", 64, "slot-major"),
    ("float16", "partial-traditional", 96, "head-major"),
    ("bfloat16", "partial-freqs-inf", 128, "slot-major"),
    ("float32", "odd-pairs", 128, "head-major"),
    ("bfloat16", "partial-base-scaled", 64, "head-major"),
])
def test_qk_norm_rope_parity(qkn_lib, dtype, variant, head_dim, layout):
    """Rows (7 tokens x 10 heads = 70) that do not fill the last 8-row threadgroup, shuffled order."""
    from registry.norm import NormConfig
    from tests.rope_cases import rope_variant
    from tests.test_qk_norm_rope_pool_fused import LAYOUTS as QL, check as qcheck, make

    rope, norm = rope_variant(variant, head_dim), NormConfig(1e-6, float(head_dim == 96))
    args = make(7, 8, 2, head_dim, QL[layout](12, 2, head_dim), dtype, [5, -1, 0, 11, -1, 3, 7], seed=head_dim)
    qcheck(qkn(qkn_lib, rope, norm, seed=head_dim)(*args), args, rope, norm, dtype)


def test_qk_norm_rope_out_of_range_slots_never_write(qkn_lib):
    from registry.norm import NormConfig
    from registry.rope import RopeConfig
    from tests.test_qk_norm_rope_pool_fused import check as qcheck, make

    rope, norm = RopeConfig(32, traditional=True), NormConfig(1e-5, 1.0)
    slots = [4, 5, 10**6, INT32_MAX, -1, INT32_MIN, 0, 3]
    args = make(len(slots), 4, 2, 64, (4, 2, 64), "float16", slots)
    qcheck(qkn(qkn_lib, rope, norm)(*args, check_slots=False), args, rope, norm, "float16")


def test_qk_norm_rope_sanitizer_catches_a_missing_bound(emu_cache):
    from registry.norm import NormConfig
    from registry.rope import RopeConfig
    from tests.test_qk_norm_rope_pool_fused import make

    lib = compile_source(mutated(emu_cache, "slot >= 0 && slot < pool_size", "slot >= 0", source=QKN_SOURCE), emu_cache,
                         include_dirs=[QKN_SOURCE.parent])
    args = make(2, 2, 2, 64, (4, 2, 64), "float32", [4, 0])
    with pytest.raises(SanitizerError, match=r"WRITE of 4 bytes at byte -?\d+ of buffer\([56]\) [kv]_pool"):
        qkn(lib, RopeConfig(64), NormConfig(1e-6))(*args, check_slots=False)


@pytest.mark.parametrize("name, guard", [("kv_pool_store", " || (POOL_LAYOUT != 0 && pool_rows < 1)"),
                                         ("qk_norm_rope_pool_fused", " && (POOL_LAYOUT == 0 || pool_rows > 0)")])
@pytest.mark.parametrize("mutant", [False, True], ids=["kernel", "mutant"])
def test_head_major_guard_against_zero_rows(emu_cache, kv_lib, qkn_lib, name, guard, mutant):
    """Scalars that disagree (pool_size 4, pool_rows 0, head-major): the kernel writes nothing;
    without its zero-rows guard it would divide by zero, which UBSan reports."""
    from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
    from registry.norm import NormConfig
    from registry.rope import RopeConfig
    from tests.test_qk_norm_rope_pool_fused import make

    source = KV_SOURCE if name == "kv_pool_store" else QKN_SOURCE
    lib = (kv_lib if name == "kv_pool_store" else qkn_lib) if not mutant else compile_source(
        mutated(emu_cache, guard, "", source=source), emu_cache, include_dirs=[source.parent])
    if name == "kv_pool_store":
        kernel, args = emulated(KvPoolStoreKernel, lib, name), case(2, 2, 8, (2, 2, 0, 8), "float32", "float32", [0, 3])
    else:
        kernel = emulated(QkNormRopePoolFusedKernel, lib, name, (RopeConfig(8), NormConfig(1e-6)))
        args = make(2, 2, 2, 8, (2, 2, 0, 8), "float32", [0, 3])
    key, scalars, grid, group = kernel.launch_config(*args)
    launcher = kernel._launcher
    run = lambda: launcher.run(launcher.plan(key, dict(scalars, pool_size=4), grid=grid, threadgroup=group),
                               kernel.launch_arrays(*args))
    if not mutant:
        assert run()[-1].shape == (2, 2, 0, 8)
        return
    with pytest.raises(SanitizerError, match="division by zero"):
        run()


# ----------------------------------------------------------------------------- strided activations

ROPE_SOURCE = PROJECT_ROOT / "metal_src" / "rope_pool_fused.metal"
SOURCES = {"rope_pool_fused": ROPE_SOURCE, "kv_pool_store": KV_SOURCE, "qk_norm_rope_pool_fused": QKN_SOURCE}


@pytest.fixture(scope="module")
def rope_lib(emu_cache):
    return compile_kernel(MANIFEST.kernel("rope_pool_fused"), emu_cache)


def strided_kernel(name, lib, seed=0):
    from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
    from tests.test_strided_activations import NORM, ROPE

    cls, config = {"rope_pool_fused": (RopePoolFusedKernel, ROPE), "kv_pool_store": (KvPoolStoreKernel, None),
                   "qk_norm_rope_pool_fused": (QkNormRopePoolFusedKernel, (ROPE, NORM))}[name]
    return emulated(cls, lib, name, config, seed=seed)


def reference_call(name, kernel, acts, pos, slots, pools, weights):
    if name == "kv_pool_store":
        return kernel.reference(acts[1], acts[2], slots, *pools)
    return kernel.reference(*acts, pos, slots, *pools, *(weights if name == "qk_norm_rope_pool_fused" else ()))


@pytest.mark.parametrize("name", list(SOURCES))
@pytest.mark.parametrize("kind, dtype, pool_dtype, head_major, seq_len", [
    ("transposed", "float16", "float16", False, 3),     # the attention's own q/k/v
    ("transposed", "bfloat16", "bfloat16", True, 1),    # a decode step: [B, H, 1, D]
    ("sliced", "bfloat16", "float32", True, 3),         # an odd element offset: every input read element-wise
    ("features-strided", "float32", "float32", False, 3),
    ("reversed", "float16", "bfloat16", True, 3),       # negative strides: the first element is not the lowest
    ("contiguous", "float32", "float16", False, 3),
])
def test_strided_views_match_rows_and_the_reference(rope_lib, kv_lib, qkn_lib, name, kind, dtype, pool_dtype,
                                                    head_major, seq_len):
    """[B, H, L, D] views reach the emulated kernel as they lie (the emulator binds only the storage
    their elements span, ASan-bounded, at the first element's offset): q_out/k_out come back in the
    views' shape with the bits of the same kernel on contiguous token-major rows, pools alike, and
    within tolerance of the reference path."""
    from tests.test_strided_activations import bits, call, case, views

    lib = {"rope_pool_fused": rope_lib, "kv_pool_store": kv_lib, "qk_norm_rope_pool_fused": qkn_lib}[name]
    kernel = strided_kernel(name, lib, seed=seq_len)
    qkv, pos, slots, pools, weights = case(dtype, pool_dtype, head_major, seq_len, seed=len(kind))
    acts = [views(x, kind) for x in qkv]
    rows = [mx.contiguous(to_rows(a)) for a in acts]
    got = call(name, kernel, acts, pos, slots, pools, weights)
    want = call(name, kernel, rows, pos, slots, pools, weights)
    ref = reference_call(name, kernel, acts, pos, slots, pools, weights)
    outs = 0 if name == "kv_pool_store" else 2
    tol = max(TOL[dtype], TOL[pool_dtype])
    for j, (g, w, r) in enumerate(zip(got, want, ref)):
        if j < outs:
            assert g.shape == acts[j].shape and r.shape == acts[j].shape, (name, j, g.shape)
            g, r = to_rows(g), to_rows(r)
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{name} {kind}: output {j} differs from rows")
        np.testing.assert_allclose(to_np(g), to_np(r), atol=tol, rtol=tol, err_msg=f"{name} {kind}: output {j}")


@pytest.mark.parametrize("name, old, new", [
    # act_layout 1 with the head and sequence strides swapped: wrong elements (or outside the view)
    ("rope_pool_fused", "long(h) * s.y + long(t % L) * s.z", "long(h) * s.z + long(t % L) * s.y"),
    ("qk_norm_rope_pool_fused", "long(h) * s.y + long(t % L) * s.z", "long(h) * s.z + long(t % L) * s.y"),
    # the feature stride taken as 1
    ("kv_pool_store", "long(t % L) * s.z + long(d) * s.w", "long(t % L) * s.z + long(d)"),
])
def test_strided_parity_catches_a_misread_stride(emu_cache, name, old, new):
    """The strided parity test can fail: a kernel that misapplies one stride is caught, by a value
    that differs or by ASan reading outside the view's elements."""
    from tests.test_strided_activations import call, case, views

    source = SOURCES[name]
    lib = compile_source(mutated(emu_cache, old, new, source=source), emu_cache, include_dirs=[source.parent])
    qkv, pos, slots, pools, weights = case("float32", "float32", False, 3, seed=1)
    kernel = strided_kernel(name, lib)
    acts = [views(x, "features-strided") for x in qkv]
    with pytest.raises((AssertionError, SanitizerError)):
        got = call(name, kernel, acts, pos, slots, pools, weights)
        want = call(name, kernel, [mx.contiguous(to_rows(a)) for a in acts], pos, slots, pools, weights)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(to_rows(g) if g.ndim == 4 else g), np.array(w))


def test_a_read_past_a_view_is_caught(emu_cache):
    """The emulator binds a strided input as the span of its own elements: one element past the last
    feature of a row lands outside it, and ASan names the buffer."""
    from tests.test_strided_activations import call, case, views

    lib = compile_source(mutated(emu_cache, "long(t % L) * s.z + long(d) * s.w", "long(t % L) * s.z + long(d + 1) * s.w",
                                 source=KV_SOURCE), emu_cache, include_dirs=[KV_SOURCE.parent])
    qkv, pos, slots, pools, weights = case("float32", "float32", False, 3, seed=2)
    acts = [views(x, "transposed") for x in qkv]
    with pytest.raises(SanitizerError, match=r"READ of 4 bytes at byte \d+ of buffer\([01]\) [kv] "):
        call("kv_pool_store", strided_kernel("kv_pool_store", lib), acts, pos, slots, pools, weights)


# ----------------------------------------------------------------------------- decode_attention

@pytest.fixture(scope="module")
def da_lib(emu_cache):
    return compile_kernel(MANIFEST.kernel("decode_attention"), emu_cache)


@pytest.mark.parametrize("dtype", list(MX_DTYPES))
def test_decode_attention_parity(da_lib, dtype):
    """The Metal source, emulated and sanitized, against the NumPy oracle of tests/test_decode_attention:
    a head-major cache with padded and ring rows, then a strided query over a slot table (L = 3, a
    window, soft-capping) whose unchecked table and valid ranges point outside the pool."""
    from registry.kernels.decode_attention import DecodeAttentionKernel
    from tests.test_decode_attention import TOL as DA_TOL, head_major_case, oracle

    kernel = emulated(DecodeAttentionKernel, da_lib, "decode_attention")
    dt = MX_DTYPES[dtype]
    q, kp, vp, _, _ = head_major_case(2, 8, 2, 1, 64, 12, dt, seed=4)
    kv_len, kv_end = mx.array([12, 7], dtype=mx.int32), mx.array([12, 3], dtype=mx.int32)
    got = kernel(q, kp, vp, kv_len, kv_end, scale=0.125)
    np.testing.assert_allclose(to_np(got), oracle(q, kp, vp, kv_len, kv_end, None, 0.125), atol=DA_TOL[dt],
                               rtol=DA_TOL[dt])
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((2, 3, 4, 32)).astype(np.float32)).astype(dt).transpose(0, 2, 1, 3)
    pool = lambda: mx.array(rng.standard_normal((16, 2, 32)).astype(np.float32)).astype(dt)
    kp, vp = pool(), pool()
    table = mx.array([[3, 16, 1, 9, -1, 4], [INT32_MAX, 2, 5, 7, 0, INT32_MIN]], dtype=mx.int32)
    kv_len = mx.array([6, 99], dtype=mx.int32)          # row 1 clamps to the table's 6 columns
    got = kernel(q, kp, vp, kv_len, None, table, scale=0.2, window=4, softcap=20.0, check=False)
    want = oracle(q, kp, vp, kv_len, kv_len, np.array(table), 0.2, 4, 20.0)
    np.testing.assert_allclose(to_np(got), want, atol=DA_TOL[dt], rtol=DA_TOL[dt])


# ----------------------------------------------------------------------------- quantized stores

QUANT_SOURCES = {name: PROJECT_ROOT / "metal_src" / f"{name}.metal"
                 for name in ("kv_quant_pool_store", "rope_quant_pool_fused")}


@pytest.fixture(scope="module")
def quant_libs(emu_cache):
    return {name: compile_kernel(MANIFEST.kernel(name), emu_cache) for name in QUANT_SOURCES}


def quant_kernel(libs, name, rope=None, norm=None, fmt=None, seed=0, lib=None):
    from registry.kernels.kv_quant_pool_store import KvQuantPoolStoreKernel
    from registry.kernels.rope_quant_pool_fused import QkNormRopeQuantKernel, RopeQuantKernel

    if name == "kv_quant_pool_store":
        return emulated(KvQuantPoolStoreKernel, lib or libs[name], name, fmt, seed=seed)
    cls = RopeQuantKernel if norm is None else QkNormRopeQuantKernel
    return emulated(cls, lib or libs[name], name, (rope, norm, fmt), seed=seed)


@pytest.mark.parametrize("bits, gs, dtype, layout, L", [
    (4, 32, "float16", "slot-major", 0), (8, 64, "bfloat16", "head-major", 0), (4, 128, "float32", "head-major", 0),
    (8, 32, "float32", "slot-major", 0), (8, 128, "bfloat16", "head-major", 1), (4, 64, "float16", "head-major", 3),
])
def test_quant_store_parity(quant_libs, bits, gs, dtype, layout, L):
    """Bit for bit the oracle of MLX's Metal quantize (ties away from zero, the maximum from 0), on the
    rows with ties and an all-negative group; L > 0: the attention's [B, H, L, D] views."""
    from registry.kernels._base import PoolFormat
    from tests.test_quant_pool_store import LAYOUTS as QL, assert_pools, expected, quant_pools, rows, token_rows

    rng = np.random.default_rng(bits + gs)
    fmt, H, D = PoolFormat(bits, gs), 2, 128
    if L:
        kv = rows(rng, (2 * L, 2 * H, D), dtype, bits=bits).reshape(2, L, 2 * H, D).transpose(0, 2, 1, 3)
        k, v = kv[:, :H], kv[:, H:]
        slots = mx.array([b * 4 + l for b in range(2) for l in range(L)], dtype=mx.int32)
    else:
        k, v = rows(rng, (5, H, D), dtype, bits=bits), rows(rng, (5, H, D), dtype, 20.0, bits=bits)
        slots = mx.array([3, 1, -1, 7, 5], dtype=mx.int32)
    pools = quant_pools(rng, QL[layout](8), H, D, fmt, dtype)
    got = quant_kernel(quant_libs, "kv_quant_pool_store", fmt=fmt, seed=bits)(k, v, slots, *pools)
    assert_pools(got, expected(pools, slots, token_rows(k), token_rows(v), fmt, gpu=True))


@pytest.mark.parametrize("dtype, variant, norm, fmt, layout", [
    ("float32", "full-base", None, (8, 64), "slot-major"),
    ("bfloat16", "partial-traditional", (1e-5, 1.0), (4, 32), "head-major"),
    ("float16", "odd-pairs", (1e-6, 0.0), (8, 128), "head-major"),
])
def test_rope_quant_parity(quant_libs, dtype, variant, norm, fmt, layout):
    """q_out/k_out within the float kernels' tolerance of the reference; the pools the oracle's (Metal
    rules) quantization of the k_out returned and of v, bit for bit. 6 tokens x 12 rows = 72 rows: the
    last 8-row threadgroup is partial."""
    from registry.kernels._base import PoolFormat
    from registry.norm import NormConfig
    from tests.rope_cases import rope_variant
    from tests.test_quant_pool_store import LAYOUTS as QL, assert_pools, expected, quant_pools, rows

    rng = np.random.default_rng(len(variant))
    fmt, T, Hq, Hkv, D = PoolFormat(*fmt), 6, 8, 2, 128
    rope, norm = rope_variant(variant, D), None if norm is None else NormConfig(*norm)
    q, k = rows(rng, (T, Hq, D), dtype, 3.0), rows(rng, (T, Hkv, D), dtype, 0.5)
    v = rows(rng, (T, Hkv, D), dtype, bits=fmt.bits)
    pos = mx.array(rng.integers(0, 5000, T).astype(np.int32))
    slots = mx.array([5, 6, -1, 7, 2, INT32_MAX], dtype=mx.int32)
    w = () if norm is None else (rows(rng, (1, 1, D), dtype, 0.5).reshape(D), rows(rng, (1, 1, D), dtype).reshape(D))
    pools = quant_pools(rng, QL[layout](8), Hkv, D, fmt, dtype)
    kernel = quant_kernel(quant_libs, "rope_quant_pool_fused", rope, norm, fmt, seed=T)
    got = kernel(q, k, v, pos, slots, *pools, *w, check_slots=False)
    ref = kernel.reference(q, k, v, pos, slots, *pools, *w)
    tol = TOL[dtype] * (1 if norm is None else 2)
    for g, r in zip(got[:2], ref[:2]):
        np.testing.assert_allclose(to_np(g), to_np(r), atol=tol, rtol=tol)
    assert_pools(got[2:], expected(pools, slots, got[1], v, fmt, gpu=True))


@pytest.mark.parametrize("name, old, new", [
    ("kv_quant_pool_store", "slot >= 0 && slot < pool_size", "slot >= 0"),
    ("rope_quant_pool_fused", "slot >= 0 && slot < pool_size", "slot >= 0"),
])
def test_quant_sanitizer_catches_a_missing_bound(emu_cache, quant_libs, name, old, new):
    """Slots past the pool, unchecked: the kernels write nothing there (the oracle says which rows
    change); without the bound ASan stops the write into the pool."""
    from registry.kernels._base import PoolFormat
    from registry.rope import RopeConfig
    from tests.test_quant_pool_store import assert_pools, expected, quant_pools, rows

    rng = np.random.default_rng(0)
    fmt = PoolFormat(4, 32)
    k, v, q = rows(rng, (4, 2, 64), "float32"), rows(rng, (4, 2, 64), "float32"), rows(rng, (4, 2, 64), "float32")
    slots = mx.array([4, INT32_MAX, 0, INT32_MIN], dtype=mx.int32)
    pools = quant_pools(rng, (4,), 2, 64, fmt, "float32")
    rope = RopeConfig(64)
    call = (lambda kern: kern(k, v, slots, *pools, check_slots=False)) if name == "kv_quant_pool_store" else (
        lambda kern: kern(q, k, v, mx.zeros((4,), mx.int32), slots, *pools, check_slots=False)[2:])
    got = call(quant_kernel(quant_libs, name, rope, None, fmt))
    assert_pools(got, expected(pools, slots, k, v, fmt, gpu=True))    # position 0: k_out is k, exactly
    source = QUANT_SOURCES[name]
    lib = compile_source(mutated(emu_cache, old, new, source=source), emu_cache, include_dirs=[source.parent])
    with pytest.raises(SanitizerError, match=r"WRITE of 4 bytes at byte -?\d+ of buffer\(\d+\) [kv]_pool"):
        call(quant_kernel(quant_libs, name, rope, None, fmt, lib=lib))



# ----------------------------------------------------------------------------- quantized decode attention

@pytest.fixture(scope="module")
def daq_lib(emu_cache):
    return compile_kernel(MANIFEST.kernel("decode_attention_quantized"), emu_cache)


@pytest.mark.parametrize("layout, bits, gs, L, window, softcap, dtype", [
    ("head-major", 8, 64, 1, 0, 0.0, "float32"),
    ("head-major", 4, 32, 3, 5, 0.0, "bfloat16"),     # ring order, causal among three queries, a window
    ("slot-major", 4, 128, 2, 0, 20.0, "float16"),    # a table with padding, soft-capping
])
def test_quantized_decode_attention_parity(daq_lib, layout, bits, gs, L, window, softcap, dtype):
    """The Metal kernel against decode_attention's oracle on the pools' fp32 values, every buffer at its
    exact size (ASan): padding slots of the table and rows past kv_len are never read."""
    from registry.kernels._base import PoolFormat
    from registry.kernels.decode_attention_quantized import DecodeAttentionQuantizedKernel
    from tests.test_decode_attention import oracle
    from tests.test_decode_attention_quantized import TOL, arr, check, fp32, quantized

    rng = np.random.default_rng(bits + L)
    fmt, D, dt = PoolFormat(bits, gs), 128, MX_DTYPES[dtype]
    q = arr(rng, (2, 4, L, D), dt)
    if layout == "head-major":
        kp, vp = quantized(arr(rng, (2, 2, 10, D), dt), fmt), quantized(arr(rng, (2, 2, 10, D), dt), fmt)
        kv_len, kv_end, table = mx.array([10, 6], dtype=mx.int32), mx.array([4, 10], dtype=mx.int32), None
    else:
        kp, vp = quantized(arr(rng, (9, 2, D), dt), fmt), quantized(arr(rng, (9, 2, D), dt), fmt)
        table = mx.array([[3, 0, 8, 5], [7, -1, 9, INT32_MAX]], dtype=mx.int32)
        kv_len = kv_end = mx.array([4, 4], dtype=mx.int32)
    kernel = emulated(DecodeAttentionQuantizedKernel, daq_lib, "decode_attention_quantized", fmt, seed=L)
    got = kernel(q, kp, vp, kv_len, kv_end, table, scale=0.09, window=window, softcap=softcap, check=False)
    want = oracle(q, fp32(kp, fmt), fp32(vp, fmt), kv_len, kv_end, None if table is None else np.array(table), 0.09,
                  window, softcap)
    check(got, want, dt, TOL)
