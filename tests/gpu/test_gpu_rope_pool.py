"""GPU-only checks of the native rope_pool_fused (CUDA or Metal). The parity matrix and the in-place
tests of tests/test_native_rope_pool_fused.py run on the GPU too, since they use the default device."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from registry.rope import RopeConfig
from tests.test_native_rope_pool_fused import native_kernel, rope_pool_fused_reference

pytestmark = pytest.mark.gpu


def test_ordering_in_multi_layer_graphs_repeated(native_artifacts):
    """200 multi-layer graphs: each layer's consumer reads only the returned pools (never q_rot), so
    only the registered pool outputs order it after the kernel."""
    rope = RopeConfig(128, base=5e5)
    kernel = native_kernel(rope)
    rng = np.random.default_rng(0)
    layers, T, S = 8, 16, 64
    k = [mx.array(rng.standard_normal((T, 8, 128)).astype(np.float32)).astype(mx.bfloat16) for _ in range(layers)]
    v = [mx.array(rng.standard_normal((T, 8, 128)).astype(np.float32)).astype(mx.bfloat16) for _ in range(layers)]
    q = [mx.array(rng.standard_normal((T, 32, 128)).astype(np.float32)).astype(mx.bfloat16) for _ in range(layers)]
    mx.eval(k, v, q)
    v_sums = [mx.sum(x.astype(mx.float32)).item() for x in v]
    for it in range(200):
        slots = mx.array(rng.permutation(S)[:T].astype(np.int32))
        pos = mx.array(rng.integers(0, 4096, T).astype(np.int32))
        sums = []
        for layer in range(layers):
            kp = mx.zeros((S, 8, 128), dtype=mx.bfloat16)
            vp = mx.zeros((S, 8, 128), dtype=mx.bfloat16)
            _, _, kp, vp = kernel(q[layer], k[layer], v[layer], pos, slots, kp, vp, check_slots=False)
            sums.append(mx.sum(vp.astype(mx.float32)))   # reads only the pool
        got = mx.stack(sums)
        mx.eval(got)
        np.testing.assert_allclose(np.array(got), v_sums, rtol=1e-3, err_msg=f"iteration {it}")


SANITIZER_SCRIPT = textwrap.dedent("""
    import mlx.core as mx, numpy as np
    from registry.rope import RopeConfig
    from tests.test_native_rope_pool_fused import native_kernel
    kernel = native_kernel(RopeConfig(128))
    T, S = 64, 8
    mk = lambda *s: mx.array(np.ones(s, np.float32)).astype(mx.float16)
    slots = mx.array(np.array([S, S + 1, 10**6, 2**31 - 1, -1, -(2**31)] * 10 + [0, 1, 2, 3], np.int32))
    pos = mx.arange(T, dtype=mx.int32)
    out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, mk(S, 8, 128), mk(S, 8, 128),
                 check_slots=False)
    mx.eval(out)
    print("rows written:", int(mx.sum(out[2][:, 0, 0] != 1).item()))
    # Head-major [B, Hkv, S, D] float32 pools with float16 activations: 2 x 4 = 8 slots.
    f32 = lambda *s: mx.array(np.ones(s, np.float32))
    out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, f32(2, 8, 4, 128), f32(2, 8, 4, 128),
                 check_slots=False)
    mx.eval(out)
    print("head-major rows written:", int(mx.sum(out[2][:, 0, :, 0] != 1).item()))
""")


def test_compute_sanitizer_out_of_range_slots(native_artifacts, tmp_path):
    if not mx.cuda.is_available():
        pytest.skip("compute-sanitizer is CUDA-only")
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        pytest.fail("compute-sanitizer not found on PATH or in /usr/local/cuda/bin")
    script = tmp_path / "oob.py"
    script.write_text(SANITIZER_SCRIPT)
    env = dict(os.environ, MLX_USE_CUDA_GRAPHS="0", PYTHONPATH=os.getcwd())
    p = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, str(script)],
                       capture_output=True, text=True, env=env, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    assert "rows written:" in out
    assert "head-major rows written: 4" in out
