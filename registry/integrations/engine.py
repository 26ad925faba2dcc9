"""`python -m registry.integrations.engine`: run the slot-pool engine on a tiny mlx-lm model.

Prints the kernel sets selected per layer configuration, what runs (native kernel or reference),
the generated tokens per request and decode tokens/s. Random weights: the tokens are meaningless,
the code path is the real one."""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from ..errors import MlxAotError
from .coverage import ARCHS


def main(argv: list[str] | None = None) -> int:
    names = {a.split(" ")[0]: a for a in ARCHS if "MLA" not in a}
    names.update({a: a for a in ARCHS if "MLA" not in a})
    p = argparse.ArgumentParser(prog="python -m registry.integrations.engine", description=__doc__)
    p.add_argument("--arch", default="llama", help=f"one of: {', '.join(sorted(set(names)))}")
    p.add_argument("--prompts", type=int, default=3, help="number of requests (different prompt lengths)")
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate per request")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--pool-size", type=int, default=4096)
    args = p.parse_args(argv)
    if args.arch not in names:
        p.error(f"--arch {args.arch!r}: choose from {', '.join(sorted(set(names)))}")
    for name, value in (("--prompts", args.prompts), ("--tokens", args.tokens), ("--pool-size", args.pool_size)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")

    from .mlx_lm import build_model
    from .slot_engine import SlotEngine

    mx.random.seed(0)
    cfg = ARCHS[names[args.arch]]
    model = build_model(cfg, dtype=getattr(mx, args.dtype))
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=3 + 4 * i).tolist() for i in range(args.prompts)]
    try:
        engine = SlotEngine(model, pool_size=args.pool_size)
        print(f"model: {names[args.arch]} ({args.dtype}, random weights) on {mx.default_device()}")
        print(engine.kernels.explain())
        out = engine.generate(prompts, args.tokens)
    except (MlxAotError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, (prompt, toks) in enumerate(zip(prompts, out["tokens"])):
        print(f"request {i}: prompt {len(prompt)} tokens -> {toks}")
    print(f"prefill {out['prefill_s'] * 1e3:.1f} ms; decode {out['decode_tokens_per_s']:.1f} tokens/s "
          f"({len(prompts)} requests{', stepped one at a time' if engine.per_request else ', batched'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
