"""The float32 noise floor of mlx-lm against itself on the current device, and the engine
tolerances derived from it (tests/test_engine.py).

The floor: the largest logit difference between mlx-lm's own forced decode of a prompt at batch 1
and the same prompt as row 0 of a batch of 3. The engine decodes several requests at once, so its
GEMMs have other shapes than mlx-lm's batch of 1, and with MLX's default on CUDA float32 GEMMs run in
TF32, whose rounding depends on the shape (the floors below were measured so; tests/conftest.py now
turns TF32 off unless MLX_ENABLE_TF32 is set). On the CPU the floor is fp32 round-off (about 1e-6).

Measured on the H200 (tests/gpu/diag_noise.py, docs/gpu-runs.md, 2026-12-01, 50 architectures x 3
requests): floors 1.4e-5 to 5.3e-3, and the engine's largest difference from mlx-lm at most 1.20x
the floor of the same request. Hence:
- logits: engine vs mlx-lm within NOISE_FACTOR x floor + CPU_ATOL, NOISE_FACTOR = 2 (the worst 1.20
  with margin), CPU_ATOL = 2e-4 the fp32 round-off of the gathered attention seen on the CPU;
- tokens: identical up to the first step where mlx-lm's own top-2 margin is below 2 x NOISE_FACTOR x
  floor: past such a near-tie the next token is decided by noise. Every token difference seen on the
  H200 was at such a step (gemma3 request 2 at step 2: margin 1.9e-3, floor 4.6e-3; ministral3 at
  step 8: 1.6e-5 vs 1.2e-3; qwen2_moe at step 9: 3.9e-4 vs 1.2e-3). On the CPU that bound is about
  4e-6, so tokens are compared to the end.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

NOISE_FACTOR = 2.0
CPU_ATOL = 2e-4


def forced(model, prompts: list[list[int]], tokens: list[int]) -> np.ndarray:
    from registry.integrations.mlx_lm import make_own_cache

    cache = make_own_cache(model)
    batch = len(prompts)
    rows = [model(mx.array(prompts, dtype=mx.int32), cache=cache)[:, -1]]
    for t in tokens[:-1]:
        rows.append(model(mx.array([[t]] * batch, dtype=mx.int32), cache=cache)[:, -1])
    return np.array(mx.stack(rows, axis=1).astype(mx.float32))       # [B, steps, V]


def noise_floor(model, prompt: list[int], tokens: list[int], one: np.ndarray | None = None) -> float:
    """`one`: mlx-lm's forced logits at batch 1 when the caller has them already."""
    one = forced(model, [prompt], tokens)[0] if one is None else one
    three = forced(model, [prompt] * 3, tokens)[0]
    return float(np.abs(one - three).max())


def logits_atol(floor: float) -> float:
    return NOISE_FACTOR * floor + CPU_ATOL


def compared_steps(reference_logits: np.ndarray, floor: float) -> int:
    """Steps whose tokens must agree: up to mlx-lm's first top-2 margin below 2 x NOISE_FACTOR x floor."""
    top2 = np.sort(reference_logits, axis=-1)[:, -2:]
    near = np.nonzero(top2[:, 1] - top2[:, 0] < 2 * NOISE_FACTOR * floor)[0]
    return int(near[0]) if len(near) else len(reference_logits)


def assert_tokens_match(model, prompt: list[int], got: list[int], label: str) -> None:
    """`got` equals mlx-lm's own greedy decode up to its first near-tie (above) on this device."""
    from registry.integrations.engine import mlx_lm_greedy

    want = mlx_lm_greedy(model, prompt, len(got))
    one = forced(model, [prompt], want)[0]
    n = compared_steps(one, noise_floor(model, prompt, want, one))
    assert got[:n] == want[:n], f"{label}: {got} vs mlx-lm {want} (compared {n} steps)"
