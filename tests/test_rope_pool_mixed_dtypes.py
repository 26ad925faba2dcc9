"""Pools of another float dtype than q/k/v (docs/kernel-abi.md, "Mixed dtypes"): the manifest's
`dtype_group: pool` and `<act>/<pool>` entry keys, the launcher's per-buffer dtype check, and parity
of the reference and the CPU native kernel with the NumPy oracle. The emulated Metal kernel is
covered in tests/test_metal_emulation.py, the GPU in tests/gpu/."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelArgumentError, KernelRegistry, rope_pool_fused, rope_pool_fused_reference
from registry.core import SelectionContext, backend_of
from registry.errors import ManifestError
from registry.kernels.rope_pool_fused import build
from registry.manifest import load_manifest
from registry.rope import RopeConfig
from tests._oracle import by_slot, rope_pool_numpy
from tests.rope_cases import MIXED, MX_DTYPES, TOL, make_case, rope_variant, to_np
from tests.test_manifest import GOOD, write

SPEC = KernelRegistry.from_yaml().manifest.kernel("rope_pool_fused")
SLOTS = [5, -1, 0, 11, 12, 3, 2**31 - 1]   # 12 slots: 12 and INT32_MAX are out of range


def tol(act: str, pool: str) -> float:
    return max(TOL[act], TOL[pool])


def check(out, args, rope, act, pool):
    """Against the float64 oracle, and exactly: each pool row is the returned k_rot / v row
    converted to the pool's dtype (the kernels convert on the store, after rounding to act)."""
    want = rope_pool_numpy(*[to_np(a) for a in args], rope)
    for name, got, w, dt in zip(("q_rot", "k_rot", "k_pool", "v_pool"), out, want, (act, act, pool, pool)):
        assert got.dtype == MX_DTYPES[dt] and got.shape == w.shape, name
        np.testing.assert_allclose(to_np(got), w, atol=tol(act, pool), rtol=tol(act, pool), err_msg=name)
    written = [(t, s) for t, s in enumerate(SLOTS) if 0 <= s < by_slot(to_np(args[5])).shape[0]]
    rows = mx.array([s for _, s in written])
    toks = mx.array([t for t, _ in written])
    k_rows = by_slot(np.array(out[2].astype(mx.float32)))[np.array(rows)]
    v_rows = by_slot(np.array(out[3].astype(mx.float32)))[np.array(rows)]
    np.testing.assert_array_equal(k_rows, np.array(out[1][toks].astype(MX_DTYPES[pool]).astype(mx.float32)))
    np.testing.assert_array_equal(v_rows, np.array(args[2][toks].astype(MX_DTYPES[pool]).astype(mx.float32)))


# ----------------------------------------------------------------------------- the manifest

def test_real_manifest_declares_every_mixed_pair():
    assert {f"{a}/{p}" for a, p in MIXED} | set(MX_DTYPES) == set(SPEC.entries)
    groups = {b.name: b.dtype_group for b in SPEC.signature.buffers}
    assert groups["k_pool"] == groups["v_pool"] == "pool" and groups["q"] is None


def _toy(**change):
    data = copy.deepcopy(GOOD)
    kernel = data["kernels"][0]
    for key, value in change.items():
        if key == "pool":
            kernel["signature"]["buffers"][2].update(value)
        else:
            kernel[key] = value
    return data


@pytest.mark.parametrize("data, expected", [
    (_toy(entries={"float32": "a", "float32/float16": "b"}),
     "entries: 'float32/float16' names a pool dtype, but no signature buffer has `dtype_group: pool`"),
    (_toy(pool={"dtype_group": "pool"}, entries={"float32/float32": "a"}),
     "entries: 'float32/float32' repeats one dtype: write 'float32'"),
    (_toy(pool={"dtype_group": "pool"}, entries={"float32/int32": "a"}),
     "entries: 'float32/int32' is not one of float16, bfloat16, float32, nor '<activation dtype>/<pool dtype>'"),
    (_toy(pool={"dtype_group": "pool"}, entries={"float32/float16/bfloat16": "a"}), "is not one of"),
    (_toy(pool={"dtype_group": "kv"}), "signature.buffers[2].dtype_group: 'kv' is not one of pool"),
    (_toy(pool={"dtype_group": "pool", "dtype": "int32"}),
     "signature.buffers[2].dtype_group: only an input or inplace buffer without a fixed dtype takes a group"),
    (_toy(pool={"dtype_group": 3}), "signature.buffers[2].dtype_group: expected a string"),
])
def test_bad_dtype_groups_and_entry_keys_name_file_line_field(tmp_path, data, expected):
    path = write(tmp_path, data)
    with pytest.raises(ManifestError) as e:
        load_manifest(path)
    assert expected in str(e.value)
    line = int(str(e.value).split(":")[1])
    assert "entries" in str(e.value) or "dtype_group" in path.read_text().splitlines()[line - 1]


def test_good_mixed_toy_manifest(tmp_path):
    data = _toy(pool={"dtype_group": "pool"}, entries={"float32": "a", "bfloat16/float32": "b"})
    k = load_manifest(write(tmp_path, data)).kernels[0]
    assert k.entries == {"float32": "a", "bfloat16/float32": "b"}
    assert [b.dtype_group for b in k.signature.buffers] == [None, None, "pool"]


# ----------------------------------------------------------------------------- the wrapper's contract

@pytest.mark.parametrize("pools, message", [
    (lambda p: (p.astype(mx.int32), p.astype(mx.int32)),
     "k_pool dtype mlx.core.int32 is not float16, bfloat16 or float32"),
    (lambda p: (p.astype(mx.uint16), p.astype(mx.uint16)), "k_pool dtype mlx.core.uint16 is not"),
    (lambda p: (p, p.astype(mx.float16)), "v_pool dtype mlx.core.float16 differs from k_pool dtype mlx.core.float32"),
])
def test_non_float_or_mismatched_pools_are_argument_errors(pools, message):
    q, k, v, pos, slots, kp, _ = make_case(2, 2, 2, 16, 4, "bfloat16", [0, 1], pool_dtype="float32")
    kp, vp = pools(kp)
    with pytest.raises(KernelArgumentError, match=message):
        rope_pool_fused(q, k, v, pos, slots, kp, vp, rope=RopeConfig(16))
    with pytest.raises(KernelArgumentError, match=message):
        rope_pool_fused_reference(q, k, v, pos, slots, kp, vp, rope=RopeConfig(16))


@pytest.mark.parametrize("act, pool", MIXED)
@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
def test_reference_mixed_pools_match_oracle(act, pool, batch):
    rope = rope_variant("partial-base-scaled", 64)
    args = make_case(len(SLOTS), 8, 2, 64, 12 if batch is None else 6, act, SLOTS, seed=1, batch=batch,
                     pool_dtype=pool)
    check(rope_pool_fused_reference(*args, rope=rope), args, rope, act, pool)


# ----------------------------------------------------------------------------- native (CPU in CI)

def native_kernel(rope):
    ctx = SelectionContext(attention="mha", rope=rope, rope_error="", n_heads=0, n_kv_heads=0, head_dim=0,
                           dtype=None, backend=backend_of(None))
    kernel = build(SPEC, ctx)
    assert kernel.implementation == f"native-{ctx.backend}", kernel.reason
    return kernel


@pytest.mark.parametrize("act, pool", MIXED)
@pytest.mark.parametrize("batch", [None, 2], ids=["slot-major", "head-major"])
@pytest.mark.parametrize("variant", ["full-traditional-freqs", "odd-pairs"])
def test_native_mixed_pools(native_artifacts, act, pool, batch, variant):
    rope = rope_variant(variant, 128)
    args = make_case(len(SLOTS), 8, 2, 128, 12 if batch is None else 6, act, SLOTS, seed=2, batch=batch,
                     pool_dtype=pool)
    before = by_slot(to_np(args[5]))
    out = native_kernel(rope)(*args[:5], mx.array(args[5]), mx.array(args[6]), check_slots=False)
    check(out, args, rope, act, pool)
    untouched = sorted(set(range(12)) - {5, 0, 11, 3})
    np.testing.assert_array_equal(by_slot(to_np(out[2]))[untouched], before[untouched])
    ref = rope_pool_fused_reference(*args, rope=rope)
    for got, want in zip(out, ref):
        np.testing.assert_allclose(to_np(got), to_np(want), atol=tol(act, pool), rtol=tol(act, pool))


def test_native_mixed_pool_is_updated_in_place(native_artifacts):
    from tests.test_native_rope_pool_fused import data_ptr
    args = make_case(2, 4, 2, 64, 4, "bfloat16", [1, 3], pool_dtype="float32")
    kp, vp = args[5], args[6]
    before = data_ptr(kp), data_ptr(vp)
    _, _, kp_new, vp_new = native_kernel(RopeConfig(64))(*args[:5], kp, vp)
    assert (data_ptr(kp_new), data_ptr(vp_new)) == before and kp_new.dtype == mx.float32
    assert mx.array_equal(vp_new[3], args[2][1].astype(mx.float32))


def test_launcher_checks_each_buffer_against_its_group(native_artifacts):
    launcher = native_kernel(RopeConfig(64))._launcher
    scalars = {s.name: 1 for s in SPEC.signature.scalars}
    plan = launcher.plan("bfloat16/float32", scalars, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert plan.entry == "rope_pool_fused_bf16_f32" and plan.dtype == "bfloat16/float32"
    q, k, v, pos, slots, kp, vp = make_case(1, 2, 2, 64, 4, "bfloat16", [0], pool_dtype="float32")
    inv = mx.zeros((32,))
    with pytest.raises(ValueError, match="buffer 5 has dtype bfloat16, the entry expects float32"):
        launcher.run(plan, [q, k, v, kp.astype(mx.bfloat16), vp, pos, slots, inv])
    with pytest.raises(ValueError, match="buffer 0 has dtype float32, the entry expects bfloat16"):
        launcher.run(plan, [q.astype(mx.float32), k, v, kp, vp, pos, slots, inv])
    with pytest.raises(KernelArgumentError, match="no entry for dtype float16/int32"):
        launcher.plan("float16/int32", scalars, grid=(1, 1, 1), threadgroup=(1, 1, 1))
