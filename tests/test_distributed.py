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
