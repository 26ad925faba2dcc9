"""Primitives in one decode step's graph, per slot-engine mode and for mlx-lm's own step (with its
own caches and with the drop-in fused cache): the count MLX evaluates one by one (each costs host
time to encode on CUDA, whatever its size). Device-independent; docs/benchmarks/e2e-root-cause.md.

    python -m benchmarks.graph_count [--layers 16]
"""
from __future__ import annotations

import argparse
import collections
import re
import tempfile

import mlx.core as mx

from .cases import layer_count


def count(arrays) -> collections.Counter:
    """Primitive names of the lazy graph behind `arrays` (mx.export_to_dot's nodes)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        text = open(f.name).read()
    names = re.findall(r'label ="?([A-Za-z][A-Za-z0-9_]*)', text) or re.findall(r'label="([A-Za-z][A-Za-z0-9_]*)', text)
    return collections.Counter(n for n in names if not n.startswith("x") or n in ("x",))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.graph_count")
    p.add_argument("--layers", type=layer_count, default=16, help="decoder layers of the model, 1-256 (default 16)")
    args = p.parse_args(argv)
    from registry.integrations.mlx_lm import build_kernel_sets, build_model, make_own_cache, make_prompt_cache
    from registry.integrations.slot_engine import SlotEngine

    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=args.layers, intermediate_size=512,
               num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, vocab_size=1000,
               rope_theta=500000.0, tie_word_embeddings=True)
    mx.random.seed(0)
    model = build_model(cfg, dtype=mx.bfloat16)
    kernels = build_kernel_sets(model)
    rows = {}
    for mode in ("module", "fused", "reference"):
        engine = SlotEngine(model, kernels=kernels, mode=mode, pool_size=256)
        rid = engine.add_request([1] * 16, 8)
        engine.step()
        engine.flush() if hasattr(engine, "flush") else None
        r = engine.requests[rid]
        logits = engine._forward([r], mx.array([[1]], dtype=mx.int32))
        rows[f"engine {mode}"] = count([logits])
    for name, make in (("mlx_lm own cache", make_own_cache), ("mlx_lm fused cache", make_prompt_cache)):
        cache = make(model)
        mx.eval(model(mx.array([[1] * 16]), cache=cache))
        rows[name] = count([model(mx.array([[1]]), cache=cache)])
    for name, c in rows.items():
        print(f"{name:22s} {sum(c.values()):5d} nodes ({sum(c.values()) / args.layers:.1f} per layer): "
              + ", ".join(f"{k} {v}" for k, v in c.most_common(12)))


if __name__ == "__main__":
    main()
