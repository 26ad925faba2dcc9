"""metal_src/ kernels run on the CPU through tests/metal_emu/ (host C++ + a shim of the Metal
Shading Language), over the launch geometry the wrapper uses on Metal, against the NumPy oracle;
out-of-range slots under AddressSanitizer. What this does and does not prove: docs/metal.md."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from registry.kernels.rope_pool_fused import metal_geometry, pick_heads_per_thread
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT
from tests._oracle import rope_pool_numpy
from tests.metal_emu.emulator import (EmulatedKernel, UnsupportedMetalFeature, compile_kernel, from_bfloat16_bits,
                                      to_bfloat16_bits, translate)
from tests.rope_cases import TOL, matrix, rope_variant

SPEC = load_manifest().kernel("rope_pool_fused")
SOURCE = PROJECT_ROOT / "metal_src" / "rope_pool_fused.metal"
NP_STORAGE = {"float32": np.float32, "float16": np.float16}


@pytest.fixture(scope="module")
def emu_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("metal_emu")


@pytest.fixture(scope="module")
def kernel(emu_cache):
    return EmulatedKernel(compile_kernel(SOURCE, emu_cache))


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    return to_bfloat16_bits(x) if dtype == "bfloat16" else x.astype(NP_STORAGE[dtype])


def from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    return from_bfloat16_bits(x) if dtype == "bfloat16" else x.astype(np.float32)


def launch_args(rope, T, Hq, Hkv, D, S, hpt):
    """Function constants and bytes exactly as the Metal launcher derives them from kernels.yaml."""
    values = dict(n_tokens=T, pool_size=S, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D, rotary_dims=rope.rotary_dims,
                  traditional=int(rope.traditional), heads_per_thread=hpt, pos_scale=rope.pos_scale, mscale=rope.mscale)
    bits = lambda s: (struct.unpack("<I", struct.pack("<f", values[s.name]))[0] if s.type == "float32"
                      else values[s.name] & 0xFFFFFFFF)
    constants = [bits(s) for s in SPEC.signature.scalars if s.specialize]
    plain = [np.array([values[s.name]], np.int32 if s.type == "int32" else np.float32)
             for s in SPEC.signature.scalars if not s.specialize]
    return constants, plain


def run_case(kernel, rope, dtype, T, Hq, Hkv, D, S, slots, seed=0, hpt=None):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v, kp, vp = f(T, Hq, D), f(T, Hkv, D), f(T, Hkv, D), f(S, Hkv, D), f(S, Hkv, D)
    pos = rng.integers(0, 5000, T).astype(np.int32)
    slots = np.asarray(slots, np.int32)
    # Inputs rounded to the storage dtype first, so the oracle sees what the kernel sees.
    q, k, v, kp, vp = (from_storage(to_storage(a, dtype), dtype) for a in (q, k, v, kp, vp))
    bufs = {"q": to_storage(q, dtype), "k": to_storage(k, dtype), "v": to_storage(v, dtype),
            "q_out": to_storage(np.zeros_like(q), dtype), "k_out": to_storage(np.zeros_like(k), dtype),
            "k_pool": to_storage(kp, dtype), "v_pool": to_storage(vp, dtype), "positions": pos, "slots": slots,
            "inv_freq": rope.inv_freq()}
    hpt = hpt or pick_heads_per_thread(Hq, Hkv, T)
    constants, plain = launch_args(rope, T, Hq, Hkv, D, S, hpt)
    grid, group = metal_geometry(T, Hq, Hkv, D, rope.rotary_dims, hpt, np.dtype(np.float32).itemsize)
    ordered = [bufs[b.name] for b in SPEC.signature.buffers] + plain
    kernel.call(SPEC.entries[dtype], ordered, constants, grid, group)
    got = [from_storage(bufs[n], dtype) for n in ("q_out", "k_out", "k_pool", "v_pool")]
    want = rope_pool_numpy(q, k, v, pos, slots, kp, vp, rope)
    return got, want


@pytest.mark.parametrize("dtype, gqa, head_dim, variant", matrix())
def test_parity_matrix(kernel, dtype, gqa, head_dim, variant):
    rope = rope_variant(variant, head_dim)
    hkv = 2 if gqa < 7 else 1
    slots = [5, -1, 0, 11, -1, 3, 7]
    got, want = run_case(kernel, rope, dtype, len(slots), hkv * gqa, hkv, head_dim, 12, slots, seed=head_dim)
    for name, g, w in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, want):
        np.testing.assert_allclose(g, w, atol=TOL[dtype], rtol=TOL[dtype], err_msg=name)


@pytest.mark.parametrize("hpt", [1, 3, 4, 8])
def test_heads_per_thread_not_dividing_head_counts(kernel, hpt):
    rope = rope_variant("partial-traditional", 128)
    got, want = run_case(kernel, rope, "float32", 5, 28, 4, 128, 8, [0, 1, -1, 7, 2], hpt=hpt)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=3e-3, rtol=3e-3)


ASAN_MAIN = r'''
#include <climits>
#include <cstdio>
int main() {
  const int T = 8, Hq = 4, Hkv = 2, D = 64, S = 4;
  float* q = new float[T * Hq * D](); float* k = new float[T * Hkv * D](); float* v = new float[T * Hkv * D]();
  float* qo = new float[T * Hq * D]; float* ko = new float[T * Hkv * D];
  float* kp = new float[S * Hkv * D](); float* vp = new float[S * Hkv * D]();
  int* pos = new int[T]; int* slots = new int[T]; float* inv = new float[D / 2];
  const int bad[T] = {S, S + 1, 1000000, INT_MAX, -1, INT_MIN, 0, 3};
  for (int t = 0; t < T; ++t) { pos[t] = t; slots[t] = bad[t]; }
  for (int i = 0; i < D / 2; ++i) inv[i] = 0.01f * i;
  int n_tokens = T, pool = S;
  void* buffers[12] = {q, k, v, qo, ko, kp, vp, pos, slots, inv, &n_tokens, &pool};
  float one = 1.0f; unsigned one_bits; std::memcpy(&one_bits, &one, 4);
  uint32_t constants[8] = {Hq, Hkv, D, D, 0, 1, one_bits, one_bits};
  int grid[3] = {D / 2, T, Hq + Hkv}, group[3] = {32, 8, 1};
  rope_pool_fused_f32(buffers, grid, group, constants, 8);
  std::printf("ok\n");
  return 0;
}
'''


def _asan_available() -> bool:
    return shutil.which("g++") is not None


@pytest.mark.skipif(not _asan_available(), reason="needs g++ with AddressSanitizer")
def test_out_of_range_slots_under_address_sanitizer(emu_cache, tmp_path):
    exe = compile_kernel(SOURCE, emu_cache, sanitize=True, extra=ASAN_MAIN)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")   # the driver's buffers live until exit
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
    # The check can fail: the same kernel without its pool-size bound is caught.
    broken = tmp_path / "broken.metal"
    broken.write_text(SOURCE.read_text().replace("slot >= 0 && slot < pool_size", "slot >= 0"))
    assert broken.read_text() != SOURCE.read_text()
    exe = compile_kernel(broken, emu_cache, sanitize=True, extra=ASAN_MAIN)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0 and "heap-buffer-overflow" in p.stderr


@pytest.mark.parametrize("snippet, feature", [
    ("threadgroup float scratch[32];", "threadgroup"),
    ("threadgroup_barrier(mem_flags::mem_threadgroup);", "threadgroup_barrier"),
    ("float s = simd_sum(1.0f);", "simd_sum"),
    ("float z = metal::tanh(1.0f);", "tanh"),
])
def test_unsupported_features_fail_loudly(emu_cache, tmp_path, snippet, feature):
    src = tmp_path / "x.metal"
    src.write_text(SOURCE.read_text().replace("const bool is_q = g < gq;", snippet + "\n  const bool is_q = g < gq;"))
    with pytest.raises(UnsupportedMetalFeature, match=feature):
        compile_kernel(src, emu_cache)


def test_unknown_attribute_fails_loudly(tmp_path):
    src = tmp_path / "y.metal"
    src.write_text(SOURCE.read_text().replace("uint3 gid [[thread_position_in_grid]])",
                                              "uint3 gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]])"))
    with pytest.raises(UnsupportedMetalFeature, match=r"\[\[thread_index_in_simdgroup\]\]"):
        translate(src)
