"""compute-sanitizer memcheck of every kernel in kernels.yaml on out-of-range slots (CUDA only):
slots past the pool, INT32 extremes and negatives, in both pool layouts, with a pool dtype other than
the activations'; for decode_attention, tables pointing outside the pool and valid ranges that are
negative or past the cache, unchecked. A kernel added to kernels.yaml without a case here fails,
naming this file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from registry import KernelRegistry

pytestmark = pytest.mark.gpu

_COMMON = """
import mlx.core as mx, numpy as np
T, S = 64, 8
mk = lambda *s: mx.array(np.ones(s, np.float32)).astype(mx.float16)
f32 = lambda *s: mx.array(np.ones(s, np.float32))
slots = mx.array(np.array([S, S + 1, 10**6, 2**31 - 1, -1, -(2**31)] * 10 + [0, 1, 2, 3], np.int32))
pos = mx.arange(T, dtype=mx.int32)
def report(name, pools, rows, before=1):
    mx.eval(pools)
    print(name, "rows written:", int(mx.sum(rows != before).item()))
"""

# Per kernel: the launches (slot-major f16 pools; head-major [2, Hkv, 4, D] f32 pools = 8 slots).
CASES = {
    "rope_pool_fused": """
from registry.rope import RopeConfig
from tests.test_native_rope_pool_fused import native_kernel
kernel = native_kernel(RopeConfig(128))
out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, mk(S, 8, 128), mk(S, 8, 128), check_slots=False)
report("slot-major", out, out[2][:, 0, 0])
out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, f32(2, 8, 4, 128), f32(2, 8, 4, 128), check_slots=False)
report("head-major", out, out[2][:, 0, :, 0])
""",
    "kv_pool_store": """
from tests.test_kv_pool_store import native_kernel
kernel = native_kernel()
zeros = lambda *s, dt=mx.float16: mx.zeros(s, dt)   # k/v rows are ones: a written row differs from 0
out = kernel(mk(T, 8, 128), mk(T, 8, 128), slots, zeros(S, 8, 128), zeros(S, 8, 128), check_slots=False)
report("slot-major", out, out[0][:, 0, 0], before=0)
out = kernel(mk(T, 8, 128), mk(T, 8, 128), slots, zeros(2, 8, 4, 128, dt=mx.float32), zeros(2, 8, 4, 128, dt=mx.float32), check_slots=False)
report("head-major", out, out[0][:, 0, :, 0], before=0)
""",
    "qk_norm_rope_pool_fused": """
from registry.norm import NormConfig
from registry.rope import RopeConfig
from tests.test_qk_norm_rope_pool_fused import native_kernel
kernel = native_kernel(RopeConfig(128), NormConfig(1e-6, 1.0))
w = mk(128)
out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, mk(S, 8, 128), mk(S, 8, 128), w, w, check_slots=False)
report("slot-major", out, out[2][:, 0, 0])
out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, f32(2, 8, 4, 128), f32(2, 8, 4, 128), w, w, check_slots=False)
report("head-major", out, out[2][:, 0, :, 0])
""",
    # quantized pools (4-bit, group 32): the scales of a written row of ones are nonzero
    "kv_quant_pool_store": """
from registry.kernels._base import PoolFormat
from tests.test_quant_pool_store import native_store
kernel = native_store(PoolFormat(4, 32))
def qpools(*lead):
    shape = lambda w: (lead[0], 8, lead[1], w) if len(lead) == 2 else (lead[0], 8, w)
    return [mx.zeros(shape(w), dt) for _ in "kv" for w, dt in ((16, mx.uint32), (4, mx.float16), (4, mx.float16))]
out = kernel(mk(T, 8, 128), mk(T, 8, 128), slots, *qpools(S), check_slots=False)
report("slot-major", out, out[1][:, 0, 0], before=0)
out = kernel(mk(T, 8, 128), mk(T, 8, 128), slots, *qpools(2, 4), check_slots=False)
report("head-major", out, out[1][:, 0, :, 0], before=0)
""",
    "rope_quant_pool_fused": """
from registry.kernels._base import PoolFormat
from registry.norm import NormConfig
from registry.rope import RopeConfig
from tests.test_quant_pool_store import native_rope
kernel = native_rope(RopeConfig(128), NormConfig(1e-6, 1.0), PoolFormat(8, 64))
def qpools(*lead):
    shape = lambda w: (lead[0], 8, lead[1], w) if len(lead) == 2 else (lead[0], 8, w)
    return [mx.zeros(shape(w), dt) for _ in "kv" for w, dt in ((32, mx.uint32), (2, mx.float16), (2, mx.float16))]
w = mk(128)
out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, *qpools(S), w, w, check_slots=False)
report("slot-major", out, out[3][:, 0, 0], before=0)
out = kernel(mk(T, 32, 128), mk(T, 8, 128), mk(T, 8, 128), pos, slots, *qpools(2, 4), w, w, check_slots=False)
report("head-major", out, out[3][:, 0, :, 0], before=0)
""",
    "decode_attention": """
from tests.test_decode_attention import native_kernel
kernel = native_kernel()
q = mk(4, 32, 2, 128)
big = [2**31 - 1, -(2**31), 10**6, -1]
table = mx.array(np.array([[S, -1, 2**31 - 1, 0], [-(2**31), 10**6, 1, 2], [0, 1, 2, 3], [3, 2, 1, 0]], np.int32))
kv_len = mx.array(np.array([4, 4, -5, 2**31 - 1], np.int32))
out = kernel(q, mk(S, 8, 128), mk(S, 8, 128), kv_len, None, table, scale=0.1, check=False)
print("slot-major outputs finite:", bool(mx.all(mx.isfinite(out)).item()))
kv_end = mx.array(np.array(big, np.int32))
out = kernel(q, mk(4, 8, 6, 128), mk(4, 8, 6, 128), kv_len, kv_end, scale=0.1, window=3, check=False)
print("head-major outputs finite:", bool(mx.all(mx.isfinite(out)).item()))
lens = mx.array(np.array([2**31 - 1], np.int32))
out = kernel(mk(1, 32, 1, 128), mk(1, 8, 2048, 128), mk(1, 8, 2048, 128), lens, kv_end[:1], scale=0.1, check=False)
print("split outputs finite:", bool(mx.all(mx.isfinite(out)).item()))
""",
    # quantized pools (8-bit, group 64): table entries and ranges past the pool, a split row
    "decode_attention_quantized": """
from registry.kernels._base import PoolFormat
from tests.test_decode_attention_quantized import native_kernel
kernel = native_kernel(PoolFormat(8, 64))
qp = lambda *lead: tuple(mx.quantize(mk(*lead, 8, 128), group_size=64, bits=8))
q = mk(4, 32, 2, 128)
big = [2**31 - 1, -(2**31), 10**6, -1]
table = mx.array(np.array([[S, -1, 2**31 - 1, 0], [-(2**31), 10**6, 1, 2], [0, 1, 2, 3], [3, 2, 1, 0]], np.int32))
kv_len = mx.array(np.array([4, 4, -5, 2**31 - 1], np.int32))
out = kernel(q, qp(S), qp(S), kv_len, None, table, scale=0.1, check=False)
print("slot-major outputs finite:", bool(mx.all(mx.isfinite(out)).item()))
kv_end = mx.array(np.array(big, np.int32))
pool = lambda: tuple(x.transpose(0, 2, 1, 3) for x in mx.quantize(mk(4, 6, 8, 128), group_size=64, bits=8))
out = kernel(q, tuple(mx.contiguous(x) for x in pool()), tuple(mx.contiguous(x) for x in pool()), kv_len, kv_end,
             scale=0.1, window=3, check=False)
print("head-major outputs finite:", bool(mx.all(mx.isfinite(out)).item()))
lens = mx.array(np.array([2**31 - 1], np.int32))
long = lambda: tuple(mx.contiguous(x.transpose(0, 2, 1, 3)) for x in mx.quantize(mk(1, 2048, 8, 128), group_size=64, bits=8))
out = kernel(mk(1, 32, 1, 128), long(), long(), lens, kv_end[:1], scale=0.1, check=False)
print("split outputs finite:", bool(mx.all(mx.isfinite(out)).item()))
""",
}
# What a case prints when nothing was written or read out of range (default: the store kernels' lines).
_ATTENTION_LINES = ["slot-major outputs finite: True", "head-major outputs finite: True", "split outputs finite: True"]
EXPECT = {"decode_attention": _ATTENTION_LINES, "decode_attention_quantized": _ATTENTION_LINES}
_STORE_LINES = ["slot-major rows written: 4", "head-major rows written: 4"]

KERNELS = [k.name for k in KernelRegistry.from_yaml().manifest.kernels]
# tests/test_manifest.py checks, on every host, that each kernel of kernels.yaml has a case here.


@pytest.mark.parametrize("kernel", KERNELS)
def test_compute_sanitizer_out_of_range_slots(native_artifacts, tmp_path, kernel):
    if not mx.cuda.is_available():
        pytest.skip("compute-sanitizer is CUDA-only")
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        pytest.fail("compute-sanitizer not found on PATH or in /usr/local/cuda/bin")
    script = tmp_path / "oob.py"
    script.write_text(textwrap.dedent(_COMMON) + textwrap.dedent(CASES[kernel]))
    env = dict(os.environ, MLX_USE_CUDA_GRAPHS="0", PYTHONPATH=os.getcwd())
    p = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, str(script)],
                       capture_output=True, text=True, env=env, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    # Store kernels: only slots 0..3 are valid in both layouts, so exactly 4 rows written.
    for line in EXPECT.get(kernel, _STORE_LINES):
        assert line in out, out[-4000:]
