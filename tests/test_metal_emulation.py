"""metal_src/ kernels run on the CPU through tests/metal_emu/ (the .metal source translated onto a
host C++ shim of the Metal Shading Language, built under AddressSanitizer + UBSan, every thread of
the launch run in turn). rope_pool_fused is driven through its real Python wrapper and
registry.native.Launcher on an emulated 'metal' backend, so the launch geometry, heads-per-thread
choice, scalar packing and function constants are the ones a Mac would use; results are compared
with the float64 NumPy oracle. What this does and does not prove: docs/metal.md.

Tolerances (tests/rope_cases.TOL, |x| <= ~4, positions < 5000): float32 3e-3 (fp32 angle rounding
~ pos * 2^-23 rad against the float64 oracle), float16 6e-3 (plus one rounding to half, 2^-11
relative), bfloat16 3e-2 (one rounding to bfloat, 2^-8 relative); atol = rtol = TOL[dtype].
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from registry.errors import KernelArgumentError
from registry.kernels.rope_pool_fused import (RopePoolFusedKernel, metal_geometry, pick_heads_per_thread,
                                              rope_pool_fused_reference)
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT
from tests._oracle import by_slot, rope_pool_numpy
from tests.metal_emu.emulator import (AbiMismatch, Constant, EmulatedMetal, LaunchError,
                                      SanitizerError, UnsupportedMetalFeature, check_abi, compile_kernel,
                                      compile_source, from_bfloat16_bits, to_bfloat16_bits)
from tests.rope_cases import MIXED, MX_DTYPES, TOL, make_case, matrix, rope_variant, to_np

SPEC = load_manifest().kernel("rope_pool_fused")
SOURCE = PROJECT_ROOT / "metal_src" / "rope_pool_fused.metal"
SELFTEST = Path(__file__).resolve().parent / "metal_emu" / "testdata" / "harness_selftest.metal"
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
TOKEN_MAJOR = dict(seq_len=1, act_layout=0)   # the activation scalars of [T, H, D] q/k/v


@pytest.fixture(scope="session")
def emu_cache(request, tmp_path_factory) -> Path:
    """Runners are keyed by the sha256 of everything that builds them; pytest's cache keeps them
    between runs (a fresh CI clone builds each once)."""
    try:
        return Path(request.config.cache.mkdir("metal_emu"))
    except AttributeError:  # -p no:cacheprovider
        return tmp_path_factory.mktemp("metal_emu")


@pytest.fixture(scope="module")
def library(emu_cache):
    return compile_kernel(SPEC, emu_cache)


@pytest.fixture(scope="module")
def selftest(emu_cache):
    return compile_source(SELFTEST, emu_cache)


def emulated_kernel(library, rope, *, order="forward", seed=0) -> RopePoolFusedKernel:
    """The wrapper exactly as the registry builds it on Metal, over the emulated backend."""
    launcher = EmulatedMetal(library, SPEC, order=order, seed=seed).launcher()
    kernel = RopePoolFusedKernel(rope, backend="metal", launcher=launcher, reason="emulated")
    assert kernel.implementation == "native-metal"
    return kernel


def check_against_oracle(out, inputs, rope, dtype, pool_dtype=None):
    q, k, v, pos, slots, kp, vp = (to_np(a) for a in inputs)
    want = rope_pool_numpy(q, k, v, pos, slots, kp, vp, rope)
    tol = max(TOL[dtype], TOL[pool_dtype or dtype])
    for name, got, w in zip(("q_rot", "k_rot", "k_pool", "v_pool"), out, want):
        g = to_np(got)
        assert got.dtype == (inputs[5] if "pool" in name else inputs[0]).dtype, name
        assert not np.isnan(g).any(), f"{name}: elements the kernel never wrote (NaN sentinel)"
        np.testing.assert_allclose(g, w, atol=tol, rtol=tol, err_msg=name)
    # Rows no valid slot points at are untouched, bit for bit (either pool layout).
    S = by_slot(kp).shape[0]
    untouched = sorted(set(range(S)) - {int(s) for s in slots if 0 <= s < S})
    for name, got, before in (("k_pool", out[2], inputs[5]), ("v_pool", out[3], inputs[6])):
        assert got.shape == before.shape, f"{name}: the pool's shape changed"
        assert np.array_equal(by_slot(storage(got))[untouched], by_slot(storage(before))[untouched]), \
            f"{name}: a skipped row changed"


def storage(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


# ----------------------------------------------------------------------------- the ABI

METAL_KERNELS = [k for k in load_manifest().kernels if "metal" in k.targets]


def test_every_metal_source_is_declared():
    """A .metal file no kernels.yaml entry lists would be verified by nothing."""
    declared = {(k.root / src).resolve() for k in METAL_KERNELS for src in k.targets["metal"].sources}
    on_disk = set((PROJECT_ROOT / "metal_src").glob("*.metal"))
    assert on_disk and {p.resolve() for p in on_disk} <= declared, sorted(map(str, on_disk - declared))


@pytest.mark.parametrize("spec", METAL_KERNELS, ids=lambda k: k.name)
def test_every_metal_kernel_builds_and_matches_its_abi(emu_cache, spec):
    lib = compile_kernel(spec, emu_cache)
    check_abi(lib, spec)
    assert lib.warnings == "", f"g++ -Wall -Wextra warns about {spec.name}:\n{lib.warnings}"


def test_source_matches_kernels_yaml_abi(library):
    check_abi(library, SPEC)
    assert {e["name"] for e in library.describe()["entries"]} == set(SPEC.entries.values())
    assert library.warnings == "", f"g++ -Wall -Wextra warns about the kernel:\n{library.warnings}"


@pytest.mark.parametrize("change, message", [
    (lambda s: dataclasses.replace(s, entries={**s.entries, "float16": "rope_pool_fused_half"}),
     r"no entry 'rope_pool_fused_half' for float16"),
    (lambda s: _with_scalar(s, "traditional", type="float32"),
     r"function constant 4 \(TRADITIONAL\) is int, but scalar traditional is float32"),
    (lambda s: _with_scalar(s, "pool_size", specialize=True),
     r"function constant 6 \(POS_SCALE\) is float, but scalar heads_per_thread is int32"),
    (lambda s: _with_buffer(s, "positions", dtype="float32"),
     r"\[\[buffer\(7\)\]\] positions is a pointer to int, kernels.yaml buffer positions needs a pointer to float"),
    (lambda s: _with_buffer(s, "v", role="inplace"),
     r"\[\[buffer\(2\)\]\] v is const, but v is role inplace"),
    (lambda s: _with_buffer(s, "v_pool", dtype_group=None),
     r"rope_pool_fused_f16_bf16: \[\[buffer\(6\)\]\] v_pool is a pointer to bfloat, kernels.yaml buffer v_pool "
     r"needs a pointer to half"),
    (lambda s: dataclasses.replace(s, signature=dataclasses.replace(s.signature, buffers=s.signature.buffers[:-1])),
     r"scalar n_tokens belongs at \[\[buffer\(9\)\]\]"),
])
def test_abi_check_names_each_mismatch(library, change, message):
    with pytest.raises(AbiMismatch, match=message):
        check_abi(library, change(SPEC))


def _with_scalar(spec, name, **kw):
    scalars = tuple(dataclasses.replace(s, **kw) if s.name == name else s for s in spec.signature.scalars)
    return dataclasses.replace(spec, signature=dataclasses.replace(spec.signature, scalars=scalars))


def _with_buffer(spec, name, **kw):
    buffers = tuple(dataclasses.replace(b, **kw) if b.name == name else b for b in spec.signature.buffers)
    return dataclasses.replace(spec, signature=dataclasses.replace(spec.signature, buffers=buffers))


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("dtype, gqa, head_dim, variant", matrix())
def test_parity_matrix(library, dtype, gqa, head_dim, variant):
    """dtype x GQA 1/4/7/8 x head_dim 64/96/128/256, two RoPE variants each (full/partial,
    traditional on/off, base/periods, scaled), slots mixing -1 and valid; thread order varies."""
    rope = rope_variant(variant, head_dim)
    hkv = 2 if gqa < 7 else 1
    slots = [5, -1, 0, 11, -1, 3, 7]
    order = ("forward", "reverse", "shuffled")[(head_dim + gqa) % 3]
    kernel = emulated_kernel(library, rope, order=order, seed=head_dim)
    inputs = make_case(len(slots), hkv * gqa, hkv, head_dim, 12, dtype, slots, seed=head_dim + gqa)
    check_against_oracle(kernel(*inputs), inputs, rope, dtype)


@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("variant", ["partial-traditional", "odd-pairs"])
def test_head_major_pools(library, dtype, variant):
    """mlx-lm's [B, Hkv, S, D] pools: slot b * S + s lands at [b, :, s, :]; the other rows stay."""
    rope = rope_variant(variant, 128)
    B, S = 3, 5
    slots = [0, 14, -1, 6, 9, 4, 10]    # first and last slot, batch boundaries
    kernel = emulated_kernel(library, rope, order="shuffled", seed=B)
    inputs = make_case(len(slots), 8, 2, 128, S, dtype, slots, seed=11, batch=B)
    check_against_oracle(kernel(*inputs), inputs, rope, dtype)


def test_head_major_grouped_heads(library):
    """heads_per_thread 4 with a kv head count it does not divide, head-major: each kv head of a
    group steps pool_rows rows through the pool."""
    T, Hq, Hkv, D, S, B = 160, 36, 6, 64, 70, 3
    assert pick_heads_per_thread(Hq, Hkv, T) == 4
    rope = rope_variant("partial-base-scaled", D)
    slots = np.random.default_rng(2).permutation(B * S)[:T]
    slots[::5] = -1
    inputs = make_case(T, Hq, Hkv, D, S, "float16", slots, seed=4, batch=B)
    check_against_oracle(emulated_kernel(library, rope, order="shuffled")(*inputs), inputs, rope, "float16")


@pytest.mark.parametrize("act, pool", MIXED)
@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
def test_mixed_dtype_pools(library, act, pool, batch):
    """Pools of another float type than q/k/v: each pool row is the k_out / v row converted, bit
    for bit, and out-of-range slots (unchecked) still write nothing."""
    rope = rope_variant("partial-freqs-inf", 64)
    slots = [5, -1, 0, 11, 12, 3, INT32_MAX]
    inputs = make_case(len(slots), 4, 2, 64, 12 if batch is None else 6, act, slots, seed=7, batch=batch,
                       pool_dtype=pool)
    out = emulated_kernel(library, rope, order="shuffled", seed=len(act))(*inputs, check_slots=False)
    check_against_oracle(out, inputs, rope, act, pool)
    rows, toks = np.array([5, 0, 11, 3]), np.array([0, 2, 3, 5])
    as_pool = lambda a: by_slot(np.array(a.astype(MX_DTYPES[pool]).astype(mx.float32)))
    np.testing.assert_array_equal(as_pool(out[2])[rows], np.array(out[1].astype(MX_DTYPES[pool]).astype(mx.float32))[toks])
    np.testing.assert_array_equal(as_pool(out[3])[rows], np.array(inputs[2].astype(MX_DTYPES[pool]).astype(mx.float32))[toks])


@pytest.mark.parametrize("hpt", [1, 2, 3, 4, 8])
def test_heads_per_thread_not_dividing_head_counts(library, hpt):
    """Grouped heads with a partial last group (30 q heads, 6 kv heads), plans packed by the real
    Launcher, geometry from the wrapper's metal_geometry."""
    rope = rope_variant("partial-traditional", 128)
    T, Hq, Hkv, D, S = 5, 30, 6, 128, 8
    launcher = EmulatedMetal(library, SPEC, order="shuffled", seed=hpt).launcher()
    inputs = make_case(T, Hq, Hkv, D, S, "float16", [0, 1, -1, 7, 2], seed=hpt)
    grid, group = metal_geometry(T, Hq, Hkv, D, rope.rotary_dims, hpt, 2)
    scalars = dict(n_tokens=T, pool_size=S, pool_rows=S, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D,
                   rotary_dims=rope.rotary_dims, traditional=int(rope.traditional), heads_per_thread=hpt,
                   pos_scale=rope.pos_scale, mscale=rope.mscale, pool_layout=0, vec_width=1, **TOKEN_MAJOR)
    plan = launcher.plan("float16", scalars, grid=grid, threadgroup=group)
    q, k, v, pos, slots, kp, vp = inputs
    out = launcher.run(plan, [q, k, v, kp, vp, pos, slots, mx.array(rope.inv_freq())])
    check_against_oracle(out, inputs, rope, "float16")


def test_large_batch_takes_the_grouped_heads_path(library):
    """A batch big enough that the wrapper picks heads_per_thread > 1, with a kv head count it
    does not divide, through the wrapper."""
    T, Hq, Hkv, D, S = 160, 36, 6, 64, 200
    assert pick_heads_per_thread(Hq, Hkv, T) == 4 and Hkv % 4
    rope = rope_variant("partial-base-scaled", D)
    slots = np.random.default_rng(1).permutation(S)[:T]
    slots[::7] = -1
    inputs = make_case(T, Hq, Hkv, D, S, "bfloat16", slots, seed=3, max_pos=200_000)
    check_against_oracle(emulated_kernel(library, rope, order="shuffled")(*inputs), inputs, rope, "bfloat16")


def test_empty_batch_and_empty_pool(library):
    rope = rope_variant("full-base", 64)
    kernel = emulated_kernel(library, rope)
    inputs = make_case(0, 4, 2, 64, 6, "float32", [])
    out = kernel(*inputs)
    assert out[0].shape == (0, 4, 64) and np.array_equal(to_np(out[2]), to_np(inputs[5]))
    inputs = make_case(3, 4, 2, 64, 0, "float32", [-1, -1, -1])
    check_against_oracle(kernel(*inputs), inputs, rope, "float32")
    # A head-major pool of 0 rows (an mlx-lm cache before its first step): no slot is valid.
    inputs = make_case(3, 4, 2, 64, 0, "float32", [0, 1, -1], batch=2)
    check_against_oracle(kernel(*inputs, check_slots=False), inputs, rope, "float32")


# ----------------------------------------------------------------------------- bounds

@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("hpt", [1, 4])
@pytest.mark.parametrize("batch", [None, 3], ids=["slot-major", "head-major"])
def test_out_of_range_slots_never_write(library, dtype, hpt, batch):
    """Slots >= pool_size (up to INT32_MAX) and < 0 (down to INT32_MIN) with every buffer allocated
    to its exact size under AddressSanitizer: only the valid rows change, nothing else is touched."""
    rope = rope_variant("odd-pairs", 96)
    T, Hq, Hkv, D, S = 8, 12, 4, 96, 4
    size = S * (batch or 1)
    slots = [size, size + 1, 10**6, INT32_MAX, -1, INT32_MIN, 0, size - 1]
    inputs = make_case(T, Hq, Hkv, D, S, dtype, slots, seed=hpt, batch=batch)
    launcher = EmulatedMetal(library, SPEC, order="shuffled", seed=hpt).launcher()
    grid, group = metal_geometry(T, Hq, Hkv, D, rope.rotary_dims, hpt, inputs[0].dtype.size)
    plan = launcher.plan(dtype, dict(n_tokens=T, pool_size=size, pool_rows=S, n_q_heads=Hq, n_kv_heads=Hkv,
                                     head_dim=D, rotary_dims=rope.rotary_dims, traditional=int(rope.traditional),
                                     heads_per_thread=hpt, pos_scale=1.0, mscale=1.0,
                                     pool_layout=int(batch is not None), vec_width=1, **TOKEN_MAJOR), grid=grid,
                         threadgroup=group)
    q, k, v, pos, sl, kp, vp = inputs
    out = launcher.run(plan, [q, k, v, kp, vp, pos, sl, mx.array(rope.inv_freq())])
    check_against_oracle(out, inputs, rope, dtype)


@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
def test_wrapper_path_with_unchecked_out_of_range_slots(library, batch):
    """check_slots=False skips the wrapper's host check; the kernel alone must stay in bounds."""
    rope = rope_variant("full-traditional-freqs", 64)
    slots = [3, INT32_MAX, -7, 4 * (batch or 1)]
    inputs = make_case(4, 8, 8, 64, 4, "float16", slots, batch=batch)
    out = emulated_kernel(library, rope)(*inputs, check_slots=False)
    check_against_oracle(out, inputs, rope, "float16")


@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
def test_checked_calls_refuse_duplicate_slots_and_positions_beyond_fp32(library, batch):
    kernel = emulated_kernel(library, rope_variant("full-base", 64))
    q, k, v, pos, slots, kp, vp = make_case(4, 4, 2, 64, 4, "float32", [1, 3, -1, 1], batch=batch)
    with pytest.raises(KernelArgumentError, match=r"slots\[3\]=1 repeats slots\[0\]"):
        kernel(q, k, v, pos, slots, kp, vp)
    with pytest.raises(KernelArgumentError, match=r"positions\[2\]=-3 is outside \[0, 2\^24"):
        kernel(q, k, v, mx.array([0, 1, -3, 2], dtype=mx.int32), mx.array([0, 1, 2, 3], dtype=mx.int32), kp, vp)
    assert kernel._launcher._ext.launches == 0   # refused before any launch


@pytest.mark.parametrize("variant", ["full-base", "partial-traditional"])
def test_unchecked_extreme_positions_match_the_reference(library, variant):
    """Negative, > 2^24 and INT32 extreme positions: the Metal kernel's fp32 angles are the
    reference's (and the CPU kernel's, tests/test_rope_pool_limits.py)."""
    rope = rope_variant(variant, 64)
    args = list(make_case(8, 4, 2, 64, 8, "float32", list(range(8))))
    args[3] = mx.array([-1, -5000, INT32_MAX, INT32_MIN, 2**24, 2**24 + 1, 123456789, 0], dtype=mx.int32)
    got = emulated_kernel(library, rope)(*args, check_slots=False)
    for name, g, r in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, rope_pool_fused_reference(*args, rope=rope)):
        np.testing.assert_allclose(to_np(g), to_np(r), atol=1e-5, rtol=1e-5, err_msg=name)


def mutated(cache: Path, old: str, new: str, source: Path = SOURCE) -> Path:
    """`source` with one edit, at a path fixed by its content (line markers carry the path, so a
    stable path lets the runner cache serve later runs)."""
    text = source.read_text()
    assert text.count(old) == 1, f"mutation target {old!r} not found once in {source}"
    text = text.replace(old, new)
    out = cache / "mutants" / hashlib.sha256(text.encode()).hexdigest()[:16] / source.name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
    return out


def run_direct(lib, dtype, rope, T, Hq, Hkv, D, S, slots, hpt=1):
    launcher = EmulatedMetal(lib, SPEC).launcher()
    inputs = make_case(T, Hq, Hkv, D, S, dtype, slots)
    grid, group = metal_geometry(T, Hq, Hkv, D, rope.rotary_dims, hpt, inputs[0].dtype.size)
    plan = launcher.plan(dtype, dict(n_tokens=T, pool_size=S, pool_rows=S, n_q_heads=Hq, n_kv_heads=Hkv,
                                     head_dim=D, rotary_dims=rope.rotary_dims, traditional=int(rope.traditional),
                                     heads_per_thread=hpt, pos_scale=1.0, mscale=1.0, pool_layout=0,
                                     vec_width=1, **TOKEN_MAJOR),
                         grid=grid, threadgroup=group)
    q, k, v, pos, sl, kp, vp = inputs
    return launcher.run(plan, [q, k, v, kp, vp, pos, sl, mx.array(rope.inv_freq())])


def test_sanitizer_catches_a_missing_pool_bound(emu_cache):
    """The bounds test can fail: without its pool-size check the kernel writes past k_pool."""
    lib = compile_source(mutated(emu_cache, "slot >= 0 && slot < pool_size", "slot >= 0"), emu_cache,
                         include_dirs=[SOURCE.parent])
    with pytest.raises(SanitizerError, match=r"WRITE of \d+ bytes at byte \d+ of buffer\(5\) k_pool") as e:
        run_direct(lib, "float32", rope_variant("full-base", 64), 2, 2, 2, 64, 4, [4, 0])
    assert e.value.kind == "heap-buffer-overflow" and e.value.buffer == 5
    assert "rope_pool_fused.metal:" in str(e.value)   # the report points into the .metal source


@pytest.mark.parametrize("mutant", [False, True], ids=["kernel", "mutant"])
def test_head_major_guard_against_zero_rows(emu_cache, library, mutant):
    """Scalars that disagree (pool_size 4, pool_rows 0, head-major): the kernel writes nothing;
    without its zero-rows guard it would divide by zero, which UBSan reports."""
    lib = library if not mutant else compile_source(
        mutated(emu_cache, " && (!head_major || pool_rows > 0)", ""), emu_cache, include_dirs=[SOURCE.parent])
    rope = rope_variant("full-base", 64)
    inputs = make_case(2, 2, 2, 64, 0, "float32", [0, 1], batch=2)
    launcher = EmulatedMetal(lib, SPEC).launcher()
    grid, group = metal_geometry(2, 2, 2, 64, 64, 1, 4)
    plan = launcher.plan("float32", dict(n_tokens=2, pool_size=4, pool_rows=0, n_q_heads=2, n_kv_heads=2, head_dim=64,
                                         rotary_dims=64, traditional=0, heads_per_thread=1, pos_scale=1.0,
                                         mscale=1.0, pool_layout=1, vec_width=1, **TOKEN_MAJOR),
                         grid=grid, threadgroup=group)
    q, k, v, pos, sl, kp, vp = inputs
    run = lambda: launcher.run(plan, [q, k, v, kp, vp, pos, sl, mx.array(rope.inv_freq())])
    if not mutant:
        check_against_oracle(run(), inputs, rope, "float32")
        return
    with pytest.raises(SanitizerError, match="division by zero"):
        run()


def test_sanitizer_catches_an_out_of_bounds_read(emu_cache):
    lib = compile_source(mutated(emu_cache, "inv_freq[p]", "inv_freq[p + 1]"), emu_cache, include_dirs=[SOURCE.parent])
    with pytest.raises(SanitizerError, match=r"READ of 4 bytes at byte \d+ of buffer\(9\) inv_freq"):
        run_direct(lib, "float32", rope_variant("partial-traditional", 64), 2, 2, 2, 64, 4, [0, 1])


def test_sanitizer_catches_a_misaligned_vector_access(emu_cache):
    """Adjacent pairs move as 2-element vectors; UBSan checks their alignment like the GPU needs."""
    lib = compile_source(mutated(emu_cache, "ROTARY_DIMS + 2 * (p - half_rot)", "ROTARY_DIMS + 2 * (p - half_rot) - 1"),
                         emu_cache, include_dirs=[SOURCE.parent])
    with pytest.raises(SanitizerError, match="misaligned address") as e:
        run_direct(lib, "float16", rope_variant("partial-base-scaled", 64), 2, 2, 2, 64, 4, [0, 1])
    assert "rope_pool_fused.metal:" in str(e.value)


# ----------------------------------------------------------------------------- loud failures

@pytest.mark.parametrize("snippet, feature", [
    ("float s = simd_sum(1.0f);", "simd_sum"),
    ("atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);", "atomic_fetch_add_explicit"),
    ("texture2d<float> tex;", "texture2d"),
    ("float z = metal::smoothstep(0.0f, 1.0f, 0.5f);", "smoothstep"),
    ("float2 w = float4(1.0f).xy;", "xy"),
])
def test_unsupported_features_fail_loudly(emu_cache, snippet, feature):
    src = mutated(emu_cache, "  const bool is_q = g < gq;", f"  {snippet}\n  const bool is_q = g < gq;")
    with pytest.raises(UnsupportedMetalFeature, match=rf"unsupported Metal feature.*\b{feature}\b"):
        compile_source(src, emu_cache, include_dirs=[SOURCE.parent])


@pytest.mark.parametrize("old, new, feature", [
    ("uint3 gid [[thread_position_in_grid]]) {",
     "uint3 gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {",
     r"\[\[thread_index_in_simdgroup\]\]"),
    ("#include <metal_stdlib>", "#include <metal_stdlib>\n#include <metal_atomic>", "<metal_atomic>"),
    ("constant float MSCALE [[function_constant(7)]];",
     "constant float MSCALE [[function_constant(7)]];\nconstant int HALF_DIM = HEAD_DIM / 2;",
     "HALF_DIM initialised from function constant HEAD_DIM"),
])
def test_unsupported_declarations_fail_loudly(emu_cache, old, new, feature):
    with pytest.raises(UnsupportedMetalFeature, match=feature):
        compile_source(mutated(emu_cache, old, new), emu_cache, include_dirs=[SOURCE.parent])


def test_runner_refuses_bad_launches(library):
    """Function constants missing or mistyped, unbound buffers, unknown entries, oversized groups:
    each an error naming it, as Metal would refuse the pipeline or the dispatch."""
    bufs = {i: np.zeros(4, np.float32) for i in range(19)}   # 16 bytes: an int4 for the strides buffers
    consts = {i: Constant.of("int32", 1) for i in range(6)} | {6: Constant.of("float32", 1.0),
                                                                 7: Constant.of("float32", 1.0),
                                                                 8: Constant.of("int32", 0),
                                                                 9: Constant.of("int32", 1),
                                                                 10: Constant.of("int32", 0)}
    ok = dict(grid=(1, 1, 1), group=(1, 1, 1))
    with pytest.raises(LaunchError, match=r"function constant 7 \(float MSCALE\) has no value"):
        library.run("rope_pool_fused_f32", bufs, {i: c for i, c in consts.items() if i != 7}, **ok)
    with pytest.raises(LaunchError, match=r"function constant 4 \(TRADITIONAL\) is declared int but the launch "
                                          r"passes float32"):
        library.run("rope_pool_fused_f32", bufs, consts | {4: Constant.of("float32", 1.0)}, **ok)
    with pytest.raises(LaunchError, match=r"buffer\(9\) \(inv_freq\) is not bound"):
        library.run("rope_pool_fused_f32", {i: b for i, b in bufs.items() if i != 9}, consts, **ok)
    with pytest.raises(LaunchError, match=r"no entry rope_pool_fused_f64 .*rope_pool_fused_f16"):
        library.run("rope_pool_fused_f64", bufs, consts, **ok)
    with pytest.raises(LaunchError, match="2048 threads exceeds Metal's 1024"):
        library.run("rope_pool_fused_f32", bufs, consts, grid=(64, 64, 1), group=(32, 64, 1))


def test_launcher_validation_matches_the_extension(library):
    ext = EmulatedMetal(library, SPEC)
    with pytest.raises(ValueError, match="threadgroup >= 1"):
        ext.LaunchArgs("rope_pool_fused_f32", [0] * 10, (1, 1, 1), (0, 1, 1))
    launcher = ext.launcher()
    plan = launcher.plan("float32", {s.name: 1 for s in SPEC.signature.scalars}, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    with pytest.raises(ValueError, match="expected 8 input arrays, got 2"):
        launcher.run(plan, [mx.zeros((1,)), mx.zeros((1,))])


# ----------------------------------------------------------------------------- the harness itself

def test_threadgroup_memory_and_barriers(selftest):
    """A tree reduction in threadgroup memory across barriers, with a partial edge group."""
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    for order in ("forward", "reverse", "shuffled"):
        out = selftest.run("group_sum", {0: x, 1: np.zeros(4, np.float32), 2: np.array([100], np.uint32)},
                           {0: Constant.of("float32", 0.5)}, (100, 1, 1), (32, 1, 1), order=order, seed=7)
        want = [0.5 * x[i:i + 32].astype(np.float64).sum() for i in range(0, 100, 32)]
        np.testing.assert_allclose(out[1], want, rtol=1e-5, atol=1e-5)


def test_position_attributes(selftest):
    grid, group = (5, 3, 2), (4, 2, 2)
    out = selftest.run("positions", {0: np.zeros(5 * 3 * 2 * 17, np.uint32)}, {0: Constant.of("float32", 1.0)},
                       grid, group, order="shuffled")[0].reshape(2, 3, 5, 17)
    ngroups = [-(-g // t) for g, t in zip(grid, group)]
    for z, y, x in np.ndindex(2, 3, 5):
        gid = (x, y, z)
        tg = [c // t for c, t in zip(gid, group)]
        lid = [c % t for c, t in zip(gid, group)]
        size = [min(t, g - i * t) for t, g, i in zip(group, grid, tg)]   # edge groups are clipped
        index = (lid[2] * size[1] + lid[1]) * size[0] + lid[0]
        want = [*gid, *lid, *tg, *size, *ngroups, index, 5 * 1000000 + 3 * 1000 + 2]
        assert out[z, y, x].tolist() == want, (gid, out[z, y, x].tolist(), want)


def test_threadgroup_memory_starts_poisoned(selftest):
    out = selftest.run("read_before_write", {0: np.zeros(8, np.float32)}, {0: Constant.of("float32", 1.0)},
                       (8, 1, 1), (8, 1, 1))
    assert np.isnan(out[0]).all()


@pytest.mark.parametrize("entry, message", [
    ("divergent_barrier", r"8 of 16 threads wait at threadgroup_barrier #\d+ after 8 returned"),
    ("split_barrier", r"threads wait at different threadgroup_barrier calls"),
])
def test_barrier_misuse_is_an_error(selftest, entry, message):
    with pytest.raises(LaunchError, match=message):
        selftest.run(entry, {0: np.zeros(16, np.float32)}, {0: Constant.of("float32", 1.0)}, (16, 1, 1), (16, 1, 1))


def test_max_total_threads_attribute_is_enforced(selftest):
    limit = r"128 threads exceeds the kernel's \[\[max_total_threads_per_threadgroup\(64\)"
    with pytest.raises(LaunchError, match=limit):
        selftest.run("group_sum", {0: np.zeros(1, np.float32), 1: np.zeros(1, np.float32), 2: np.array([1], np.uint32)},
                     {0: Constant.of("float32", 1.0)}, (128, 1, 1), (128, 1, 1))


def test_thread_order_exposes_write_races(selftest):
    run = lambda order, seed=0: int(selftest.run("last_writer", {0: np.zeros(1, np.uint32)},
                                                 {0: Constant.of("float32", 1.0)}, (64, 1, 1), (32, 1, 1),
                                                 order=order, seed=seed)[0][0])
    assert run("forward") == 63 and run("reverse") == 0
    assert run("shuffled", 1) == run("shuffled", 1)          # seeded: reproducible
    assert len({run("shuffled", s) for s in range(4)}) > 1


def test_half_and_bfloat_round_like_metal(selftest):
    tie_bf = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)     # exact ties: round to even
    tie_half = [1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, -(2**-14 - 2**-25), 65519.99]
    x = np.concatenate([np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 6e-5, 3.14159265, -2.5e38,
                                  np.inf, -np.inf, np.nan, *tie_half], np.float32), tie_bf,
                        np.random.default_rng(0).standard_normal(50).astype(np.float32) * 100])
    out = selftest.run("convert", {0: x, 1: np.zeros(x.size, np.float16), 2: np.zeros(x.size, np.uint16)},
                       {0: Constant.of("float32", 1.0)}, (x.size, 1, 1), (32, 1, 1))
    with np.errstate(over="ignore"):
        assert np.array_equal(out[1], x.astype(np.float16), equal_nan=True)
    assert np.array_equal(out[2], to_bfloat16_bits(x))
    assert from_bfloat16_bits(out[2])[-52:-50].tolist() == [1.0, 1 + 4 * 2**-8]


def test_runner_cache_is_keyed_by_content(emu_cache):
    a = compile_source(SELFTEST, emu_cache)
    mtime = os.stat(a.path).st_mtime_ns
    assert compile_source(SELFTEST, emu_cache).path == a.path and os.stat(a.path).st_mtime_ns == mtime
    b = compile_source(mutated(emu_cache, "out[0] = gid;", "out[0] = gid + 1u;", SELFTEST), emu_cache)
    assert b.path != a.path and b.path.exists()
    assert b.run("last_writer", {0: np.zeros(1, np.uint32)}, {0: Constant.of("float32", 1.0)}, (4, 1, 1),
                 (4, 1, 1))[0][0] == 4

