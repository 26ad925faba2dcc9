"""The fused caches on a model sharded with mlx-lm's own `model.shard(group)`: 2 processes on
loopback started with `mlx.launch` (ring backend, CPU), each with its own kernel sets at the
sharded head counts, generating the same tokens as the unsharded model (registry/integrations/sharded.py).
About 10 s on 2 cores; marked `distributed` (deselect with -m "not distributed")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from registry.core import backend_of
from registry.paths import PROJECT_ROOT

LAUNCH = Path(sys.executable).with_name("mlx.launch")


@pytest.mark.distributed
@pytest.mark.skipif(backend_of(None) != "cpu", reason="the ring backend test runs the CPU path")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sharded_model_generates_the_unsharded_tokens(native_artifacts, arch):
    launch = str(LAUNCH) if LAUNCH.exists() else shutil.which("mlx.launch")
    assert launch, "mlx.launch (installed with mlx) not found"
    cmd = [launch, "--backend", "ring", "-n", "2", "--", sys.executable, "-m", "registry.integrations.sharded",
           "--model", arch, "--max-tokens", "8"]
    p = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and len(lines) == 2, p.stdout + p.stderr
    assert sorted(r["rank"] for r in lines) == [0, 1] and all(r["size"] == 2 for r in lines)
    for r in lines:
        assert r["same_tokens"] and r["max_logprob_diff"] <= 1e-4, r
        assert r["heads_per_rank"] == [[2, 1]], r          # 4 q / 2 kv heads unsharded
        assert r["fused_layers"] == [0, 1] and r["implementation"] == ["native-cpu"], r
    assert lines[0]["tokens"] == lines[1]["tokens"]


def _sharded(*args: str, env: dict | None = None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "registry.integrations.sharded", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_bad_setups_are_one_line_errors_not_hangs():
    """A backend named without mlx.launch (a world of one), an unavailable backend, a GPU rank on a
    machine without one, and heads that the world size cannot split: exit 2, one line, no traceback."""
    import mlx.core as mx

    from registry.integrations.coverage import ARCHS
    from registry.integrations.mlx_lm import build_model
    from registry.integrations.sharded import heads_problem

    r = _sharded("--backend", "ring")
    assert r.returncode == 2 and r.stderr.startswith("error: --backend ring: ") and "mlx.launch" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _sharded("--backend", "nccl")
    assert r.returncode == 2 and r.stderr.startswith("error: --backend nccl: "), r.stderr
    assert "Traceback" not in r.stderr
    if not (mx.cuda.is_available() and mx.device_count(mx.gpu) > 0) and not mx.metal.is_available():
        r = _sharded("--device", "gpu")
        assert r.returncode == 2 and "this rank sees no GPU" in r.stderr, r.stderr
    mx.random.seed(0)
    model = build_model(ARCHS["llama"], dtype=mx.float32)          # 4 q / 2 kv heads
    assert heads_problem(model, 2) == ""
    assert heads_problem(model, 4) == "layer 0 has n_kv_heads=2, which 4 ranks cannot split evenly"
    assert "n_heads=4, which 3 ranks" in heads_problem(model, 3)
