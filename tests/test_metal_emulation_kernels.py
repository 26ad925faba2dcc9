"""The Metal sources of kv_pool_store and qk_norm_rope_pool_fused on the CPU through tests/metal_emu/
(sanitized runner, exact-size buffers, shuffled thread order), driven through their real wrappers on
an emulated 'metal' backend and compared with the reference path; out-of-range slots under the
sanitizers, and a mutant per kernel that proves the bounds tests can fail. Strided activations for
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
