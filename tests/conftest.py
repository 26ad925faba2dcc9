"""Markers: `gpu` tests need a CUDA or Metal MLX device, `macos` tests need macOS with xcrun's Metal
toolchain. Both are skipped elsewhere with the reason, so CI (Linux, no GPU) runs everything else."""

from __future__ import annotations

import platform
import shutil

import mlx.core as mx
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or Metal GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "macos: needs macOS with the Metal toolchain (skipped elsewhere)")


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
