"""Probe (not a test): the teacher-forced bf16 logit gap between the drop-in caches and mlx-lm's own,
which sets tolerance.HALF_LOGIT_TOL (docs/engine.md, "Equivalence").

    python -m benchmarks.bf16_gap [--seeds 3] [--tokens 16] [--scale 1] [--f32] [--sizes] [model ...]

Models: architectures of coverage.md (random weights from build_model; MoE ones fail mlx-lm's own
bf16 forward on the CPU and are skipped) and benchmarks/e2e.py's sizes cut to their check layers
(random_model: normal init), by name; default: every architecture, and every size with --sizes.
Per model and seed: bf16 weights, a random 12-token prompt, mlx-lm's own greedy tokens, then both
cache kinds teacher-forced on those tokens through mlx-lm's generate_step
(generate.teacher_forced_logits, what `generate --check` runs). Per step j the gap is
max |drop-in - mlx-lm| / max |mlx-lm logit at j|; printed: the worst step, the gap with one scale
over all steps (the tests' form), where the greedy tokens first differ and what --check says there,
and with --f32 mlx-lm's own bf16 error in the same measure against a float32 run of the same
weights. --scale multiplies the weight matrices (tests/_model_dir.py writes its models at 4).
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from registry.integrations import generate as cli
from registry.integrations.coverage import ARCHS, arch_vocab
from registry.integrations.mlx_lm import build_model, import_mlx_lm_module
from registry.integrations.mlx_lm_cache import make_prompt_cache
from registry.integrations.tolerance import HALF_LOGIT_TOL

PROMPT_LEN = 12


def _models(names: list[str], scale: float) -> dict:
    """name -> (config, build(seed, dtype) -> a model with its weight matrices times `scale`)."""
    from mlx.utils import tree_flatten, tree_unflatten

    from benchmarks.e2e import SIZES, random_model

    def seeded(make, cfg):
        def build(seed, dtype):
            mx.random.seed(seed)
            model = make(cfg, dtype)
            if scale != 1:
                model.update(tree_unflatten([(k, v * scale if v.ndim >= 2 else v)
                                             for k, v in tree_flatten(model.parameters())]))
            return model
        return build

    out = {}
    for name in names:
        if name in ARCHS:
            out[name] = ARCHS[name], seeded(lambda c, dt: build_model(c, dtype=dt), ARCHS[name])
        else:
            s = SIZES[name]
            cfg = dict(s.config, num_hidden_layers=min(s.check_layers, s.config["num_hidden_layers"]))
            out[name] = cfg, seeded(random_model, cfg)
    return out


def _step_gap(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per step: max |a - ref| / max |ref|."""
    return np.abs(a - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


def measure(model, prompt: list[int], n: int, truth=None) -> dict:
    """truth: the same weights in float32, for mlx-lm's own bf16 error."""
    stock = import_mlx_lm_module("cache")
    want = cli.run(model, prompt, n, stock.make_prompt_cache(model))["tokens"]
    got = cli.run(model, prompt, n, make_prompt_cache(model))["tokens"]
    ours, _ = cli.teacher_forced_logits(model, prompt, want, make_prompt_cache(model))
    theirs, _ = cli.teacher_forced_logits(model, prompt, want, stock.make_prompt_cache(model))
    per_step = _step_gap(ours, theirs)
    out = {"step_gap": float(per_step.max()), "at": int(per_step.argmax()),
           "global_gap": float(np.abs(ours - theirs).max() / np.abs(theirs).max()),
           "divergence": cli.first_divergence(model, prompt, got, want, make_prompt_cache(model),
                                              stock.make_prompt_cache(model))}
    if truth is not None:
        f32, _ = cli.teacher_forced_logits(truth, prompt, want, stock.make_prompt_cache(truth))
        out["own"] = float(_step_gap(theirs, f32).max())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bf16_gap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="*", help="coverage.md architectures and e2e sizes (default: all architectures)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per model (weights and prompt)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per run")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the weight matrices by this")
    p.add_argument("--f32", action="store_true", help="also mlx-lm's own bf16 error against float32")
    p.add_argument("--sizes", action="store_true", help="also every e2e size")
    args = p.parse_args(argv)
    from benchmarks.e2e import SIZES

    bad = [m for m in args.model if m not in ARCHS and m not in SIZES]
    if bad:
        p.error(f"model: not a coverage.md architecture or an e2e size: {', '.join(bad)}")
    names = (args.model or list(ARCHS)) + (list(SIZES) if args.sizes else [])
    worst_step, worst_global, worst_own, rows, skipped = 0.0, 0.0, 0.0, 0, []
    for name, (cfg, build) in _models(names, args.scale).items():
        for seed in range(args.seeds):
            model = build(seed, mx.bfloat16)
            try:
                mx.eval(model(mx.array([[1, 2]]), cache=import_mlx_lm_module("cache").make_prompt_cache(model)))
            except (RuntimeError, ValueError) as e:
                skipped.append(f"{name} ({type(e).__name__})")
                break
            truth = None
            if args.f32:
                truth = build(seed, mx.bfloat16)
                truth.set_dtype(mx.float32)
            prompt = np.random.default_rng(seed).integers(0, arch_vocab(cfg), PROMPT_LEN).tolist()
            r = measure(model, prompt, args.tokens, truth)
            d = r["divergence"]
            verdict = "tokens identical" if d is None else (
                f"tokens differ at {d.step}: gap {d.gap / d.scale:.4f} of max|logit|, top-2 margin {d.margin:.3g}, "
                f"--check {'passes' if d.within_tolerance else 'FAILS'}")
            own = f", mlx-lm's own vs float32 {r['own']:.4f}" if truth is not None else ""
            print(f"{name:40s} seed {seed}: worst step {r['step_gap']:.4f} (step {r['at']}), "
                  f"one scale {r['global_gap']:.4f}{own}; {verdict}", flush=True)
            worst_step, worst_global = max(worst_step, r["step_gap"]), max(worst_global, r["global_gap"])
            worst_own = max(worst_own, r.get("own", 0.0))
            rows += 1
    print(f"{rows} runs: worst per-step gap {worst_step:.4f}, worst one-scale gap {worst_global:.4f} of max |logit|"
          + (f", worst mlx-lm's own vs float32 {worst_own:.4f}" if args.f32 else "") + f" (HALF_LOGIT_TOL = {HALF_LOGIT_TOL})")
    if skipped:
        print(f"skipped (mlx-lm's own bf16 forward fails on {mx.default_device()}): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
