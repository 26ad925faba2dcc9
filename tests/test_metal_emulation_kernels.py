"""The Metal sources of kv_pool_store and qk_norm_rope_pool_fused on the CPU through tests/metal_emu/
(sanitized runner, exact-size buffers, shuffled thread order), driven through their real wrappers on
an emulated 'metal' backend and compared with the reference path; out-of-range slots under the
sanitizers, and a mutant per kernel that proves the bounds tests can fail. (rope_pool_fused's own
emulation tests: tests/test_metal_emulation.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.kernels.kv_pool_store import KvPoolStoreKernel
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT
from tests.metal_emu.emulator import EmulatedMetal, SanitizerError, compile_kernel, compile_source
from tests.test_metal_emulation import mutated
from tests.rope_cases import MX_DTYPES
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
