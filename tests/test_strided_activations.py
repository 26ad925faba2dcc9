"""Strided activations (docs/kernel-abi.md, "Strided buffers"): every kernel reads q/k/v as the
attention hands them over ([B, H, L, D] views of the projections, slices, reversed or transposed
features) and returns q_out/k_out in that shape, with no copy node in the graph. Each case must give
the bits the same native kernel gives on the contiguous token-major rows, on the default device
(the CPU in CI, CUDA on the GPU host), and the reference path must agree with its own 3-D results."""

from __future__ import annotations

import collections
import re
import tempfile

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelRegistry
from registry.core import SelectionContext, backend_of
from registry.errors import KernelArgumentError
from registry.kernels import kv_pool_store as kv_mod
from registry.kernels import qk_norm_rope_pool_fused as qkn_mod
from registry.kernels import rope_pool_fused as rope_mod
from registry.kernels._base import to_rows
from registry.norm import NormConfig
from registry.rope import RopeConfig
from tests.rope_cases import MX_DTYPES

MANIFEST = KernelRegistry.from_yaml().manifest
B, L, HQ, HKV, D = 2, 3, 4, 2, 64
ROPE = RopeConfig(48, base=10000.0)          # partial: the pass-through tail goes through the strides too
NORM = NormConfig(eps=1e-6, weight_offset=1.0)


def context(rope=None, norm=None) -> SelectionContext:
    return SelectionContext(attention="mha", rope=rope, rope_error="", n_heads=0, n_kv_heads=0, head_dim=0,
                            dtype=None, backend=backend_of(None), qk_norm=norm, qk_norm_error="")


def kernels():
    """(name, native kernel object, number of activations it takes: 3 = q, k, v; 2 = k, v)."""
    out = []
    for mod, cfg, n in ((rope_mod, dict(rope=ROPE), 3), (qkn_mod, dict(rope=ROPE, norm=NORM), 3),
                        (kv_mod, {}, 2)):
        k = mod.build(MANIFEST.kernel(mod.KERNEL_NAME), context(**cfg))
        assert k.implementation == f"native-{backend_of(None)}", k.reason
        out.append((mod.KERNEL_NAME, k, n))
    return out


def rng_array(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[dtype])


def views(x_bl: mx.array, kind: str) -> mx.array:
    """A [B, H, L, D] view of kind `kind` whose values are x_bl [B, L, H, D] transposed."""
    if kind == "transposed":          # the attention's own: proj.reshape(B, L, H, D).transpose(0, 2, 1, 3)
        return x_bl.transpose(0, 2, 1, 3)
    if kind == "contiguous":
        return mx.contiguous(x_bl.transpose(0, 2, 1, 3))
    if kind == "sliced":              # a fused qkv projection split: an offset into a wider row
        wide = mx.concatenate([mx.zeros((B, x_bl.shape[1], 1, D), x_bl.dtype), x_bl], axis=2)
        return wide[:, :, 1:].transpose(0, 2, 1, 3)
    if kind == "features-strided":    # innermost stride != 1: the element path
        return mx.contiguous(x_bl.transpose(0, 2, 3, 1)).transpose(0, 1, 3, 2)
    if kind == "reversed":            # negative strides
        return mx.contiguous(x_bl[:, ::-1].transpose(0, 2, 1, 3))[:, :, ::-1]
    raise KeyError(kind)


KINDS = ["transposed", "contiguous", "sliced", "features-strided", "reversed"]


def case(dtype: str, pool_dtype: str, head_major: bool, seq_len: int, seed: int):
    rng = np.random.default_rng(seed)
    T = B * seq_len
    qkv = [rng_array(rng, (B, seq_len, h, D), dtype) for h in (HQ, HKV, HKV)]
    slots = mx.array(np.array([5, -1, 0, 11, 7, 2][:T], dtype=np.int32) if T <= 6 else np.arange(T, dtype=np.int32))
    pos = mx.array(rng.integers(0, 4000, size=T).astype(np.int32))
    pool_shape = (B, HKV, 8, D) if head_major else (16, HKV, D)
    pools = [rng_array(rng, pool_shape, pool_dtype) for _ in range(2)]
    weights = [rng_array(rng, (D,), dtype) for _ in range(2)]
    return qkv, pos, slots, pools, weights


def call(name, kernel, acts, pos, slots, pools, weights):
    if name == "kv_pool_store":
        return kernel(acts[1], acts[2], slots, *pools, check_slots=False)
    extra = tuple(weights) if name == "qk_norm_rope_pool_fused" else ()
    return kernel(*acts, pos, slots, *pools, *extra, check_slots=False)


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a.view(mx.uint32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, pool_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                               ("float32", "float32"), ("bfloat16", "float32")])
@pytest.mark.parametrize("seq_len", [1, 3])
def test_views_give_the_bits_of_contiguous_rows(native_artifacts, kind, dtype, pool_dtype, seq_len):
    for i, (name, kernel, _) in enumerate(kernels()):
        for head_major in (False, True):
            qkv, pos, slots, pools, weights = case(dtype, pool_dtype, head_major, seq_len, seed=i)
            acts = [views(x, kind) for x in qkv]
            rows = [mx.contiguous(to_rows(a)) for a in acts]
            want = call(name, kernel, rows, pos, slots, [mx.array(p) for p in pools], weights)
            got = call(name, kernel, acts, pos, slots, [mx.array(p) for p in pools], weights)
            outs = 2 if name != "kv_pool_store" else 0
            for j, (g, w) in enumerate(zip(got, want)):
                if j < outs:              # q_out, k_out come back in the attention's shape
                    assert g.shape == acts[j].shape, (name, j)
                    g = to_rows(g)
                np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{name} {kind} output {j}")


@pytest.mark.parametrize("kind", ["transposed", "features-strided"])
def test_reference_takes_the_same_layouts(kind):
    """The fallback path gives the same results for a [B, H, L, D] view as for its token-major rows."""
    qkv, pos, slots, pools, weights = case("float32", "float32", False, 3, seed=3)
    acts = [views(x, kind) for x in qkv]
    got = rope_mod.rope_pool_fused_reference(*acts, pos, slots, *pools, rope=ROPE)
    want = rope_mod.rope_pool_fused_reference(*[to_rows(a) for a in acts], pos, slots, *pools, rope=ROPE)
    for j, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.array(to_rows(g) if j < 2 else g), np.array(w))


def primitive_names(*arrays) -> collections.Counter:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return collections.Counter(re.findall(r'label ="?([A-Za-z][A-Za-z0-9_]*)', open(f.name).read()))


def test_a_fused_call_on_lazy_views_is_one_node(native_artifacts):
    """What the strides are for: the attention's lazy [B, H, L, D] views reach the kernel with no
    contiguous copy, reshape or transpose added by the wrapper or the launcher."""
    (name, kernel, _), *_ = kernels()
    qkv, pos, slots, pools, _ = case("bfloat16", "bfloat16", True, 1, seed=0)
    mx.eval(qkv, pools)
    acts = [(x * 2).transpose(0, 2, 1, 3) for x in qkv]          # lazy, as a projection's output is
    q_out, k_out, kp, vp = call(name, kernel, acts, pos, slots, pools, [])
    names = primitive_names(q_out, kp)
    assert names["AotLaunch"] == 1
    assert names["Contiguous"] == 0 and names["Reshape"] == 0, names
    assert names["Transpose"] == 3, names                          # the three views themselves


def test_mismatched_layouts_are_clear_errors(native_artifacts):
    (name, kernel, _), *_ = kernels()
    qkv, pos, slots, pools, _ = case("float32", "float32", False, 3, seed=0)
    acts = [x.transpose(0, 2, 1, 3) for x in qkv]
    with pytest.raises(KernelArgumentError, match=r"k must be 3-D .* like q \(2x4x3x64\), got shape 6x2x64"):
        kernel(acts[0], to_rows(acts[1]), to_rows(acts[2]), pos, slots, *pools, check_slots=False)
    with pytest.raises(KernelArgumentError, match=r"k 1x2x6x64 must have the batch and seq_len of q 2x4x3x64"):
        kernel(acts[0], acts[1].reshape(1, HKV, 6, D), acts[2].reshape(1, HKV, 6, D), pos, slots, *pools,
               check_slots=False)
