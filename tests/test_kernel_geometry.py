"""Geometry from one source: what a CUDA kernel must agree on with its launch (the vector width) is
computed by the wrapper and passed as a scalar; the kernel sources implement exactly the widths the
wrappers can pick and compute none themselves. Also: every wrapper's INPUTS match kernels.yaml."""

from __future__ import annotations

import re

import pytest

from registry.kernels import kv_pool_store, rope_pool_fused
from registry.kernels._base import PoolKernel
from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT

MANIFEST = load_manifest()


@pytest.mark.parametrize("module", [rope_pool_fused, kv_pool_store], ids=lambda m: m.KERNEL_NAME)
def test_cuda_source_implements_exactly_the_wrapper_widths(module):
    src = (PROJECT_ROOT / "cuda_src" / f"{module.KERNEL_NAME}.cu").read_text()
    assert {int(w) for w in re.findall(r"case (\d+):", src)} == set(module.CUDA_WIDTHS)
    assert "pick_width" not in src and "vec_width" in src       # no second source of the width
    spec = MANIFEST.kernel(module.KERNEL_NAME)
    assert "vec_width" in [s.name for s in spec.signature.scalars]


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("rows", [1, 40, 320, 10 ** 6])
def test_rope_pool_fused_widths_fit_the_row(itemsize, rows):
    for D in range(2, 514, 2):
        for R in range(2, D + 1, 2):
            w = rope_pool_fused.cuda_vector_width(D, R, itemsize, rows)
            assert w in rope_pool_fused.CUDA_WIDTHS and w * itemsize <= 16
            assert R % (2 * w) == 0 and (D - R) % w == 0


def test_rope_pool_fused_width_narrows_only_for_latency_bound_launches():
    width, geometry = rope_pool_fused.cuda_vector_width, rope_pool_fused.cuda_geometry
    # llama-8b decode, one token: 32 + 8 head groups; 16-byte vectors would give 320 threads
    assert width(128, 128, 2, 40) == 1
    grid, block = geometry(1, 32, 8, 128, 128, 1, 1)
    assert grid == (64, 40, 1) and block == (64, 1, 1)
    # eight tokens: halved only until the launch has LATENCY_THREADS threads
    assert width(128, 128, 2, 320) == 4
    assert 320 * (128 // 4 // 2) >= rope_pool_fused.LATENCY_THREADS > 320 * (128 // 8 // 2)
    # a prefill keeps 16-byte vectors and full blocks
    assert width(128, 128, 2, 40 * 128) == 8
    assert geometry(128, 32, 8, 128, 128, 1, 8)[1] == (256, 1, 1)
    # partial rotary and pass-through tails: a halved width still fits
    assert width(128, 64, 4, 10 ** 6) == 4 and width(96, 32, 2, 1) == 1


def test_kv_pool_store_widths_fit_the_row():
    for a in (2, 4):
        for p in (2, 4):
            for D in range(1, 300):
                w = kv_pool_store.cuda_vector_width(D, a, p)
                assert w in kv_pool_store.CUDA_WIDTHS and D % w == 0 and w * max(a, p) <= 16


@pytest.mark.parametrize("cls", [rope_pool_fused.RopePoolFusedKernel, kv_pool_store.KvPoolStoreKernel,
                                 QkNormRopePoolFusedKernel], ids=lambda c: c.NAME)
def test_wrapper_inputs_match_the_manifest(cls):
    assert issubclass(cls, PoolKernel)
    spec = MANIFEST.kernel(cls.NAME)
    assert cls.INPUTS == tuple(b.name for b in spec.signature.inputs)
    assert MANIFEST.kernel(cls.NAME).wrapper == f"registry.kernels.{cls.NAME}:build"
