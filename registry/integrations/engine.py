"""`python -m registry.integrations.engine`: run the slot-pool engine on a tiny mlx-lm model.

Prints the kernel sets selected per layer configuration, what the engine runs per layer (the fused
kernel and its implementation, the reference path, or the module's own rope), the generated tokens
per request and the decode tokens/s. Random weights: the tokens are meaningless, the code path is
the real one. With --check, also decodes each prompt alone through mlx-lm's own model call and
KVCache and fails unless the tokens are identical.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from ..errors import MlxAotError
from .coverage import ARCHS, arch_vocab


def _names() -> dict[str, str]:
    """--arch spellings: the coverage table's names and their first word ('gemma3', 'phi3', ...)."""
    names: dict[str, str] = {}
    for a in ARCHS:
        names.setdefault(a.split(" ")[0], a)
        names[a] = a
    return names


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own path: the model call with make_prompt_cache's caches, one request."""
    from .mlx_lm import make_own_cache

    cache = make_own_cache(model)
    logits = model(mx.array([prompt], dtype=mx.int32), cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        t = mx.argmax(logits, axis=-1)
        out.append(int(t.item()))
        logits = model(t[None].astype(mx.int32), cache=cache)[:, -1, :]
    return out


def main(argv: list[str] | None = None) -> int:
    names = _names()
    p = argparse.ArgumentParser(prog="python -m registry.integrations.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama", help=f"one of: {', '.join(sorted(names))}")
    p.add_argument("--prompts", type=int, default=3, help="number of requests, of different prompt lengths")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate per request")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--mode", choices=["fused", "reference", "module"], default="fused",
                   help="fused: kernel set's rope where selected; reference: rope_pool_fused_reference; "
                        "module: the model's own rope + pool scatter")
    p.add_argument("--pool-size", type=int, default=4096, help="KV slots per layer")
    p.add_argument("--check", action="store_true", help="compare with mlx-lm's own greedy decode per request")
    args = p.parse_args(argv)
    if args.arch not in names:
        p.error(f"--arch {args.arch!r}: choose from {', '.join(sorted(names))}")
    for name, value in (("--prompts", args.prompts), ("--tokens", args.tokens), ("--pool-size", args.pool_size)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")

    from .mlx_lm import build_model
    from .slot_engine import SlotEngine

    arch = names[args.arch]
    cfg = ARCHS[arch]
    mx.random.seed(0)
    model = build_model(cfg, dtype=getattr(mx, args.dtype))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, arch_vocab(cfg), size=3 + 4 * i).tolist() for i in range(args.prompts)]
    print(f"model: {arch} ({args.dtype}, random weights) on {mx.default_device()}")
    try:
        engine = SlotEngine(model, pool_size=args.pool_size, mode=args.mode)
        print(engine.kernels.explain())
        print(engine.explain())
        out = engine.generate(prompts, args.tokens)
    except (MlxAotError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, (prompt, toks) in enumerate(zip(prompts, out["tokens"])):
        print(f"request {i}: prompt {len(prompt)} tokens -> {toks}")
    print("layer calls: " + ", ".join(f"{k} {v}" for k, v in sorted(engine.calls.items())))
    print(f"prefill {out['prefill_s'] * 1e3:.1f} ms ({out['prefill_tokens']} tokens); decode "
          f"{out['decode_tokens_per_s']:.1f} tokens/s ({out['decode_tokens']} tokens in {out['decode_steps']} "
          f"steps, {len(prompts)} requests {'batched' if not engine.batch_reason else 'one at a time'})")
    if args.check:
        bad = [i for i, (prompt, toks) in enumerate(zip(prompts, out["tokens"]))
               if mlx_lm_greedy(model, prompt, args.tokens) != toks]
        if bad:
            print(f"check: requests {bad} differ from mlx-lm's own greedy decode", file=sys.stderr)
            return 1
        print(f"check: all {len(prompts)} requests match mlx-lm's own greedy decode (model call + KVCache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
