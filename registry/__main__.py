"""`python -m registry`: print the kernel sets selected for sample attention modules on this
machine (after `python -m build_tools compile`, the native implementations show up here), then run
the fused kernel once against the reference path as a smoke check."""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import build_kernel_set, rope_pool_fused_reference
from .errors import MlxAotError


class SampleAttention(nn.Module):
    """The attributes the registry reads from an attention module (mlx-lm naming)."""

    def __init__(self, n_heads: int, head_dim: int, rope: nn.Module, mla: bool = False):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.rope = rope
        if mla:
            self.kv_lora_rank = 512


SAMPLES = {
    "llama-3-8b (32/8/128, base 500000)": (SampleAttention(32, 128, nn.RoPE(128, base=500000.0)), 8, 128),
    "phi-4-mini-like (24/8/128, partial 96)": (SampleAttention(24, 128, nn.RoPE(96, base=10000.0)), 8, 128),
    "glm-4-like (32/2/128, partial 64, traditional)":
        (SampleAttention(32, 128, nn.RoPE(64, traditional=True)), 2, 128),
    "deepseek-v3-like (MLA)": (SampleAttention(128, 192, nn.RoPE(64), mla=True), 128, 192),
}


def _smoke(kernel, dtype, Hq: int, Hkv: int, D: int) -> str:
    rng = np.random.default_rng(0)
    T, S = 4, 16
    mk = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
    q, k, v, kp, vp = mk(T, Hq, D), mk(T, Hkv, D), mk(T, Hkv, D), mk(S, Hkv, D), mk(S, Hkv, D)
    pos = mx.array([0, 7, 100, 4000], dtype=mx.int32)
    slots = mx.array([3, -1, 0, 15], dtype=mx.int32)
    want = rope_pool_fused_reference(q, k, v, pos, slots, kp, vp, rope=kernel.rope)
    got = kernel(q, k, v, pos, slots, mx.array(kp), mx.array(vp))
    err = max(float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)))) for a, b in zip(got, want))
    return f"{kernel.implementation} vs reference: max |diff| = {err:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry", description=__doc__)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    print(f"device: {mx.default_device()}  dtype: {args.dtype}  mlx {mx.__version__}")
    try:
        for title, (attn, n_kv, head_dim) in SAMPLES.items():
            kset = build_kernel_set(sample_attn=attn, n_kv_heads=n_kv, head_dim=head_dim, dtype=dtype)
            print(f"\n== {title}\n{kset.explain()}")
            if kset.rope is not None:
                print("  smoke: " + _smoke(kset.rope, dtype, attn.n_heads, n_kv, head_dim))
    except MlxAotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
