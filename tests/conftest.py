"""Markers: `gpu` tests need a CUDA or Metal MLX device, `macos` tests need macOS with xcrun's Metal
toolchain. Both are skipped elsewhere with the reason, so CI (Linux, no GPU) runs everything else."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

# The toy manifests of the suite name tests.toy_wrapper as wrapper/check: allow-list it explicitly
# (docs/manifest.md, "Limits"); subprocesses started by the tests inherit it.
os.environ["MLX_AOT_HOOK_MODULES"] = "tests.toy_wrapper"
# MLX's CUDA GEMMs round float32 through TF32 by default while its batch-1 GEMV does not, so a request
# batched and the same request alone differed by ~1e-3 relative in their keys, which a quantized cache
# turns into whole quantization steps (H200, 2026-12-03: log-probs up to 0.8 apart at 4 bits, tokens
# equal). The suite's float32 comparisons test our code at full precision; a caller's own
# MLX_ENABLE_TF32 wins. MLX reads it at the first matmul, after this.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or Metal GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "macos: needs macOS with the Metal toolchain (skipped elsewhere)")
    config.addinivalue_line("markers", "distributed: starts 2 processes with mlx.launch (ring backend, loopback)")


def _has_gpu() -> bool:
    return mx.cuda.is_available() or mx.metal.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or Metal GPU; MLX sees none here")
    skip_mac = pytest.mark.skip(reason="needs macOS with xcrun (Metal toolchain)")
    has_gpu = _has_gpu()
    is_mac = platform.system() == "Darwin" and shutil.which("xcrun") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "macos" in item.keywords and not is_mac:
            item.add_marker(skip_mac)


@pytest.fixture(scope="session")
def native_artifacts(tmp_path_factory):
    """Compile the manifest's kernels for the default device's backend into a private directory
    and point the registry at it (MLX_AOT_CACHE_DIR) for the whole session."""
    import os

    from build_tools import compile_kernels
    from registry.core import backend_of

    backend = backend_of(None)
    # MLX_AOT_TEST_ARTIFACTS (tests/gpu/run_on_host.sh): a directory of artifacts built for this tree
    # just before; compile_kernels finds them fresh (content-keyed) instead of every pytest-xdist
    # worker compiling every kernel again (minutes of nvcc for the attention kernels).
    shared = os.environ.get("MLX_AOT_TEST_ARTIFACTS")
    out = Path(shared) if shared else tmp_path_factory.mktemp("artifacts")
    archs = None
    if backend == "cuda":
        from registry.native import import_ext
        archs = [import_ext().cuda_device_arch(0)]
    report = compile_kernels(targets=(backend,), out_dir=out, archs=archs)
    assert report.ok, "\n".join(r.message for r in report.results if r.status == "failed")
    old = os.environ.get("MLX_AOT_CACHE_DIR")
    os.environ["MLX_AOT_CACHE_DIR"] = str(out)
    yield out
    if old is None:
        os.environ.pop("MLX_AOT_CACHE_DIR", None)
    else:
        os.environ["MLX_AOT_CACHE_DIR"] = old
