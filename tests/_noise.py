"""The float32 noise floor of mlx-lm against itself on the current device, and the engine
tolerances derived from it (tests/test_engine.py, tests/test_integration_mlx_lm.py).

The floor: the largest logit difference between mlx-lm's own forced decode of a prompt at batch 1
and the same prompt as row 0 of a batch of 3 (the engine decodes several requests at once, so its
GEMMs have other shapes than mlx-lm's batch of 1). On the CPU it is fp32 round-off (about 1e-6); on
the H200 float32 matmuls run in TF32 and the floor is what that rounding gives at these sizes
(docs/gpu-runs.md lists the measured floors: tests/gpu/diag_noise.py).

Derived tolerance: engine vs mlx-lm logits within NOISE_FACTOR x floor + 2e-4. The engine takes the
same kind of GEMMs as the batch-of-3 run plus a gathered attention; NOISE_FACTOR covers the error
growing through the layers differently per shape and was chosen from the measured ratio of the
engine's difference to the floor on the H200 (worst seen: see docs/gpu-runs.md), with margin.
Tokens are compared up to the first step where mlx-lm's own top-2 margin is below twice that
tolerance: past a near-tie the next token is decided by noise, on any device.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

NOISE_FACTOR = 4.0
CPU_ATOL = 2e-4


def forced(model, prompts: list[list[int]], tokens: list[int]) -> np.ndarray:
    from registry.integrations.mlx_lm import make_own_cache

    cache = make_own_cache(model)
    batch = len(prompts)
    rows = [model(mx.array(prompts, dtype=mx.int32), cache=cache)[:, -1]]
    for t in tokens[:-1]:
        rows.append(model(mx.array([[t]] * batch, dtype=mx.int32), cache=cache)[:, -1])
    return np.array(mx.stack(rows, axis=1).astype(mx.float32))       # [B, steps, V]


def noise_floor(model, prompt: list[int], tokens: list[int]) -> float:
    one = forced(model, [prompt], tokens)[0]
    three = forced(model, [prompt] * 3, tokens)[0]
    return float(np.abs(one - three).max())


def logits_atol(floor: float) -> float:
    return NOISE_FACTOR * floor + CPU_ATOL


def compared_steps(reference_logits: np.ndarray, atol: float) -> int:
    """Steps whose tokens must agree: up to mlx-lm's first top-2 margin below 2 x atol."""
    top2 = np.sort(reference_logits, axis=-1)[:, -2:]
    near = np.nonzero(top2[:, 1] - top2[:, 0] < 2 * atol)[0]
    return int(near[0]) if len(near) else len(reference_logits)
