"""Shared case generation for the rope_pool_fused parity tests (CPU native, GPU, Metal emulation).
The input helpers live in the package (registry/parity.py), where `build_tools selftest` uses them too."""

from __future__ import annotations

import itertools

from registry.parity import MX_DTYPES, TOL, VARIANTS, make_case, rope_variant, to_np  # noqa: F401  (re-exported)

GQA = [1, 4, 7, 8]
HEAD_DIMS = [64, 96, 128, 256]


def matrix():
    """dtype x GQA x head_dim, each with two RoPE variants (cycled) and slot patterns mixing -1 and valid."""
    cases = []
    for n, (dtype, gqa, d) in enumerate(itertools.product(MX_DTYPES, GQA, HEAD_DIMS)):
        for j in range(2):
            cases.append((dtype, gqa, d, VARIANTS[(2 * n + j) % len(VARIANTS)]))
    return cases


# Every (activation, pool) dtype pair with an entry of its own (kernels.yaml `<act>/<pool>` keys).
MIXED = [(a, p) for a in MX_DTYPES for p in MX_DTYPES if a != p]
