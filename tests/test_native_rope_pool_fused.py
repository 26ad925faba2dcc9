"""The native primitive (registry._ext + the compiled artifact of the default device) against the
reference path and the NumPy oracle: parity matrix, in-place pools, views, ordering, fallbacks.
On the CPU this runs in CI; tests/gpu/ repeats the device-specific parts on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import ArtifactError, KernelRegistry
from registry.core import SelectionContext, backend_of
from registry.kernels.rope_pool_fused import build, rope_pool_fused_reference
from registry.native import device_indices
from registry.rope import RopeConfig
from tests._oracle import by_slot, rope_pool_numpy
from tests.rope_cases import TOL, make_case, matrix, rope_variant, to_np

SPEC = KernelRegistry.from_yaml().manifest.kernel("rope_pool_fused")


def native_kernel(rope: RopeConfig):
    ctx = SelectionContext(attention="mha", rope=rope, rope_error="", n_heads=0, n_kv_heads=0, head_dim=0,
                           dtype=None, backend=backend_of(None))
    kernel = build(SPEC, ctx)
    assert kernel.implementation == f"native-{ctx.backend}", kernel.reason
    return kernel


def data_ptr(a: mx.array) -> int:
    mx.eval(a)
    if not a.size:
        return 0
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # NumPy has no bfloat16
    return np.asarray(raw).__array_interface__["data"][0]


@pytest.mark.parametrize("dtype, gqa, head_dim, variant", matrix())
def test_parity_matrix(native_artifacts, dtype, gqa, head_dim, variant):
    rope = rope_variant(variant, head_dim)
    hkv = 2 if gqa < 7 else 1
    slots = [5, -1, 0, 11, -1, 3, 7]
    args = make_case(len(slots), hkv * gqa, hkv, head_dim, 12, dtype, slots, seed=head_dim + gqa)
    expected = rope_pool_numpy(*[to_np(a) for a in args], rope)
    reference = rope_pool_fused_reference(*args, rope=rope)
    got = native_kernel(rope)(*args[:5], mx.array(args[5]), mx.array(args[6]))
    for name, g, r, e in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, reference, expected):
        assert g.dtype == args[0].dtype and g.shape == r.shape, name
        np.testing.assert_allclose(to_np(g), e, atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{name} vs oracle")
        np.testing.assert_allclose(to_np(g), to_np(r), atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{name} vs ref")
    # Features past rotary_dims are copied bit for bit, in the outputs and in the pool.
    r = rope.rotary_dims
    assert mx.array_equal(got[0][..., r:], args[0][..., r:])
    assert mx.array_equal(got[2][mx.array([5, 0, 11, 3, 7])][..., r:], args[1][mx.array([0, 2, 3, 5, 6])][..., r:])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["partial-traditional", "odd-pairs", "full-base"])
def test_head_major_parity(native_artifacts, dtype, variant):
    """mlx-lm's [B, Hkv, S, D] pools against the oracle and the reference, out-of-range slots
    included (unchecked): slot b * S + s lands at [b, :, s, :], nothing else changes."""
    rope = rope_variant(variant, 96)
    B, S = 3, 5
    slots = [0, 14, -1, 6, 15, 9, 2**31 - 1, 4, 10]
    args = make_case(len(slots), 8, 2, 96, S, dtype, slots, seed=9, batch=B)
    expected = rope_pool_numpy(*[to_np(a) for a in args], rope)
    reference = rope_pool_fused_reference(*args, rope=rope)
    before = by_slot(to_np(args[5]))
    got = native_kernel(rope)(*args[:5], mx.array(args[5]), mx.array(args[6]), check_slots=False)
    for name, g, r, e in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, reference, expected):
        assert g.dtype == args[0].dtype and g.shape == r.shape == e.shape, name
        np.testing.assert_allclose(to_np(g), e, atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{name} vs oracle")
        np.testing.assert_allclose(to_np(g), to_np(r), atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{name} vs ref")
    untouched = sorted(set(range(B * S)) - {0, 14, 6, 9, 4, 10})
    np.testing.assert_array_equal(by_slot(to_np(got[2]))[untouched], before[untouched])
    assert mx.array_equal(got[3][2, :, 4], args[2][1])       # slot 14 = batch 2, row 4


def test_head_major_pools_are_updated_in_place(native_artifacts):
    args = make_case(2, 4, 2, 64, 8, "float16", [3, 9], batch=2)
    kp, vp = args[5], args[6]
    before = data_ptr(kp), data_ptr(vp)
    _, _, kp_new, vp_new = native_kernel(RopeConfig(64))(*args[:5], kp, vp)
    assert (data_ptr(kp_new), data_ptr(vp_new)) == before and kp_new.shape == (2, 2, 8, 64)
    assert mx.array_equal(vp_new[1, :, 1], args[2][1])


def test_head_major_out_of_range_slot_is_checked(native_artifacts):
    from registry.errors import KernelArgumentError
    args = make_case(2, 4, 2, 64, 4, "float32", [1, 8], batch=2)
    with pytest.raises(KernelArgumentError, match=r"slots\[1\]=8 is out of range for a pool of 8 slots"):
        native_kernel(RopeConfig(64))(*args)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_conversions_are_exact_at_position_zero(native_artifacts, dtype):
    """At position 0 the rotation is the identity, so every finite value, subnormals and extremes of
    the storage type included, must come back bit for bit (one exact round trip through fp32)."""
    mx_dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    info_max = 65504.0 if dtype == "float16" else 3.0e38
    tiny = 2.0 ** -24 if dtype == "float16" else 2.0 ** -133
    # (-0.0 is left out: x1*sin + x2*cos with x2 = -0 and sin = 0 is +0 in IEEE arithmetic.)
    specials = np.array([0.0, tiny, -tiny, 3 * tiny, 6.1e-5, -6.1e-5, 1.0, -2.5, info_max, -info_max,
                         0.1, 1 / 3, 1000.5, -7.0e-3, 42.0], np.float32)
    q = mx.array(np.resize(specials, (3, 4, 64))).astype(mx_dtype)
    kv = mx.array(np.resize(specials[::-1], (3, 2, 64))).astype(mx_dtype)
    pool = mx.zeros((4, 2, 64), mx_dtype)
    kernel = native_kernel(RopeConfig(48))
    pos = mx.zeros((3,), mx.int32)
    q_rot, k_rot, kp, vp = kernel(q, kv, kv, pos, mx.array([0, 1, 2], dtype=mx.int32), pool, mx.array(pool))
    bits = lambda a: np.array(a.view(mx.uint16))
    np.testing.assert_array_equal(bits(q_rot), bits(q))
    np.testing.assert_array_equal(bits(k_rot), bits(kv))
    np.testing.assert_array_equal(bits(kp[:3]), bits(kv))
    np.testing.assert_array_equal(bits(vp[:3]), bits(kv))


def test_pools_are_updated_in_place(native_artifacts):
    rope = RopeConfig(64)
    args = make_case(3, 8, 2, 64, 6, "float16", [1, -1, 4])
    kp, vp = args[5], args[6]
    before = data_ptr(kp), data_ptr(vp)
    _, _, kp_new, vp_new = native_kernel(rope)(*args[:5], kp, vp)
    assert (data_ptr(kp_new), data_ptr(vp_new)) == before        # the same buffers
    assert mx.array_equal(kp, kp_new) and mx.array_equal(vp, vp_new)  # the passed arrays see the write
    assert mx.array_equal(vp_new[4], args[2][2])


def test_a_view_of_the_pool_forces_a_copy(native_artifacts):
    """The first time the launcher takes a buffer, nothing may share it (here a view of the pool)."""
    rope = RopeConfig(64)
    args = make_case(2, 4, 2, 64, 6, "float32", [0, 1])
    kp, vp = args[5], args[6]
    view = kp[:2]
    mx.eval(view)
    snapshot = np.array(view)
    _, _, kp_new, _ = native_kernel(rope)(*args[:5], kp, vp)
    mx.eval(kp_new)
    assert data_ptr(kp_new) != data_ptr(kp)              # written into a copy
    np.testing.assert_array_equal(np.array(view), snapshot)  # the view never changes
    np.testing.assert_array_equal(np.array(kp[:2]), snapshot)
    assert not mx.array_equal(kp_new[:2], kp[:2])


def test_rebinding_keeps_the_pool_buffer_across_calls(native_artifacts):
    """The engine pattern (rebind the returned pools) writes in place every call, whether or not the
    graph is evaluated between calls (unevaluated pools go through MLX's copy-on-write, which takes
    the buffer by donation when nothing else can read it)."""
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, _, kp, vp = make_case(2, 4, 2, 64, 8, "float16", [0, 1])
    before = data_ptr(kp), data_ptr(vp)
    for step in range(3):
        slots = mx.array([2 * step, 2 * step + 1], dtype=mx.int32)
        _, _, kp, vp = kernel(q, k, v, pos, slots, kp, vp)
        mx.eval(kp, vp)
    assert (data_ptr(kp), data_ptr(vp)) == before
    for step in range(3):  # three calls, one evaluation
        slots = mx.array([2 * step, 2 * step + 1], dtype=mx.int32)
        _, _, kp, vp = kernel(q, k, v, pos, slots, kp, vp)
    assert (data_ptr(kp), data_ptr(vp)) == before
    assert mx.array_equal(vp[:6], mx.concatenate([v, v, v]))


def test_async_eval_pipelining_keeps_the_pool_buffer(native_artifacts):
    """mlx-lm's generate loop builds step n+1 while step n still runs (mx.async_eval): the pool is then
    not computed yet when the next call is built, and the launcher trusts a buffer it wrote before."""
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, _, kp, vp = make_case(4, 4, 2, 64, 64, "bfloat16", [0, 1, 2, 3])
    before = data_ptr(kp), data_ptr(vp)
    readers = []
    for step in range(6):
        slots = mx.arange(4 * step, 4 * step + 4, dtype=mx.int32)
        _, _, kp, vp = kernel(q, k, v, pos, slots, kp, vp, check_slots=False)
        readers.append(mx.sum(kp[: 4 * step + 4].astype(mx.float32)))  # a slicing reader, like attention
        mx.async_eval(readers[-1])
    assert (data_ptr(kp), data_ptr(vp)) == before
    np.testing.assert_array_equal(to_np(vp[:24]), np.concatenate([to_np(v)] * 6))


def test_dropped_pools_are_freed(native_artifacts):
    """The launcher keeps no reference to the pools it wrote: dropping them frees their memory."""
    from registry import native
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, slots, _, _ = make_case(2, 4, 2, 64, 8, "float32", [0, 1])
    mx.eval(q, k, v, pos, slots)
    owned, active = native.stats()["owned_pools"], mx.get_active_memory()
    kp, vp = mx.zeros((4096, 2, 64)), mx.zeros((4096, 2, 64))
    mx.eval(kp, vp)
    out = kernel(q, k, v, pos, slots, kp, vp)
    mx.eval(out)
    assert native.stats()["owned_pools"] == owned + 2
    del kp, vp, out
    mx.synchronize()
    assert native.stats()["owned_pools"] == owned
    assert mx.get_active_memory() <= active


def test_pending_lazy_reader_of_the_old_pool_keeps_the_old_values(native_artifacts):
    """An unevaluated op built on the pool before the call refers to the pool's array: the call writes
    a copy, so the reader sees the pool as it was, whatever the evaluation order."""
    kernel = native_kernel(RopeConfig(64))
    args = make_case(3, 4, 2, 64, 6, "float32", [1, -1, 4])
    kp, vp = args[5], args[6]
    mx.eval(kp, vp)
    old = np.array(vp[4])
    reader = vp[4] * 1                   # pending when the kernel is built
    _, _, kp_new, vp_new = kernel(*args[:5], kp, vp)
    mx.eval(kp_new, vp_new)              # the kernel runs first...
    np.testing.assert_array_equal(np.array(reader), old)   # ...the reader still sees the old row
    np.testing.assert_array_equal(np.array(vp_new[4]), np.array(args[2][2]))
    # A lazy pool that is not a launch's output goes through copy-on-write too.
    lazy_pool = vp_new * 1
    old = np.array(vp_new)
    reader = lazy_pool[1] + 0
    _, _, _, vp_lazy = kernel(*args[:4], mx.array([-1, -1, 1], dtype=mx.int32), kp_new, lazy_pool)
    mx.eval(vp_lazy)
    np.testing.assert_array_equal(np.array(reader), old[1])
    np.testing.assert_array_equal(np.array(vp_lazy[1]), np.array(args[2][2]))


@pytest.mark.parametrize("alias", ["astype", "reshape", "ellipsis", "colon"])
def test_aliases_of_a_pool_keep_their_values(native_artifacts, alias):
    """MLX returns the pool's own array for these, as a new mx.array object: after the call they hold
    the old values, as after MLX's own `pool[i] = x`, on the first call and on later calls alike."""
    make = {"astype": lambda p: p.astype(p.dtype), "reshape": lambda p: p.reshape(p.shape),
            "ellipsis": lambda p: p[...], "colon": lambda p: p[:]}[alias]
    from registry import native
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, _, kp, vp = make_case(2, 4, 2, 64, 6, "float32", [0, 1])
    for step in range(2):
        slots = mx.array([2 * step, 2 * step + 1], dtype=mx.int32)
        mx.eval(kp, vp)
        other = make(vp)
        mx.eval(other)
        snapshot = np.array(other)
        copies = native.stats()["copies"]
        _, _, kp, vp = kernel(q, k, v, pos, slots, kp, vp)
        mx.eval(kp, vp)
        np.testing.assert_array_equal(np.array(other), snapshot)
        np.testing.assert_array_equal(np.array(vp[2 * step:2 * step + 2]), np.array(v))
        assert native.stats()["copies"] == copies + 1            # v_pool only
        del other


def test_views_of_an_owned_pool_see_its_writes(native_artifacts):
    """Documented (docs/native.md): once the launcher has written a pool, arrays that view part of its
    memory (slices, reshapes to another shape), like a NumPy view of it, show its current contents.
    That is what lets attention slice the pool without the next call copying it."""
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, _, kp, vp = make_case(2, 4, 2, 64, 6, "float32", [0, 1])
    _, _, kp, vp = kernel(q, k, v, pos, mx.array([0, 1], dtype=mx.int32), kp, vp)
    mx.eval(kp, vp)
    view = vp[2:4]
    mx.eval(view)
    numpy_view = np.asarray(vp)                      # shares the buffer; MLX does not see it
    before = data_ptr(vp), data_ptr(kp)
    _, _, kp, vp = kernel(q, k, v, pos, mx.array([2, 3], dtype=mx.int32), kp, vp)
    mx.eval(kp, vp)
    assert (data_ptr(vp), data_ptr(kp)) == before    # no copy
    np.testing.assert_array_equal(np.array(view), np.array(v))
    np.testing.assert_array_equal(numpy_view[2:4], np.array(v))


def test_copies_are_counted_and_warned_once_per_kernel(native_artifacts, caplog):
    from registry import native
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, slots, kp, vp = make_case(2, 4, 2, 64, 6, "float32", [0, 1])
    mx.eval(kp, vp)
    before = native.stats()
    with caplog.at_level("WARNING", logger="registry"):
        for _ in range(3):
            keep = kp.astype(kp.dtype)               # an alias: forces a copy of k_pool each call
            _, _, kp, vp = kernel(q, k, v, pos, slots, kp, vp)
            mx.eval(kp, vp)
    after = native.stats()
    assert after["copies"] - before["copies"] == 3 and after["launches"] - before["launches"] == 3
    assert after["aliased"] - before["aliased"] == 3  # v_pool every time
    warnings = [r for r in caplog.records if "copy-on-write" in r.getMessage()]
    assert len(warnings) == 1 and "k_pool" in warnings[0].getMessage()
    assert "pool.astype(pool.dtype)" in warnings[0].getMessage()
    assert "Rebind the returned pools" in warnings[0].getMessage()       # a kernel caller's advice
    del keep


def test_same_array_as_both_pools_is_not_aliased_twice(native_artifacts):
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, slots, pool, _ = make_case(2, 4, 2, 64, 4, "float32", [0, 3])
    mx.eval(pool)
    old = np.array(pool)
    _, k_rot, kp, vp = kernel(q, k, v, pos, slots, pool, pool)
    np.testing.assert_array_equal(np.array(kp[mx.array([0, 3])]), np.array(k_rot))
    np.testing.assert_array_equal(np.array(vp[mx.array([0, 3])]), np.array(v))
    np.testing.assert_array_equal(np.array(pool), old)


def test_non_contiguous_or_lazy_pools_are_written_through_a_copy(native_artifacts):
    rope = RopeConfig(32)
    kernel = native_kernel(rope)
    q, k, v, pos, slots, kp, vp = make_case(3, 4, 2, 32, 5, "bfloat16", [4, 0, 2])
    want = rope_pool_fused_reference(q, k, v, pos, slots, kp, vp, rope=rope)
    base = mx.array(np.ascontiguousarray(to_np(kp).transpose(1, 0, 2))).astype(mx.bfloat16)
    mx.eval(base)
    kp_strided = base.transpose(1, 0, 2)            # evaluated, not row-contiguous
    vp_lazy = vp * 1                                # not evaluated yet
    got = kernel(q, k, v, pos, slots, kp_strided, vp_lazy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_np(g), to_np(w), atol=3e-2)
    np.testing.assert_array_equal(to_np(base.transpose(1, 0, 2)), to_np(kp))  # the strided source is untouched


def test_reader_of_returned_pool_sees_the_write(native_artifacts):
    """A consumer that reads only the pool (not q_rot) is ordered after the kernel."""
    rope = RopeConfig(128)
    kernel = native_kernel(rope)
    args = make_case(4, 8, 8, 128, 16, "bfloat16", [3, 9, 12, 0])
    _, k_rot, kp, vp = kernel(*args)
    total = mx.sum(kp[mx.array([3, 9, 12, 0])].astype(mx.float32)) + mx.sum(vp[mx.array([3, 9, 12, 0])].astype(mx.float32))
    want = mx.sum(k_rot.astype(mx.float32)) + mx.sum(args[2].astype(mx.float32))
    assert abs(total.item() - want.item()) < 1e-2


def test_multi_layer_multi_step_chain_matches_reference(native_artifacts):
    rope = RopeConfig(64, base=1e4)
    kernel = native_kernel(rope)
    rng = np.random.default_rng(3)
    layers, S = 4, 32
    pools = [[mx.zeros((S, 2, 64), dtype=mx.float16) for _ in range(2)] for _ in range(layers)]
    ref_pools = [[mx.zeros((S, 2, 64), dtype=mx.float16) for _ in range(2)] for _ in range(layers)]
    for step in range(3):
        slots = mx.array(rng.permutation(S)[:5].astype(np.int32))
        pos = mx.array(np.arange(5, dtype=np.int32) + step * 5)
        outs = []
        for layer in range(layers):
            q, k, v = (mx.array(rng.standard_normal(s).astype(np.float16)) for s in ((5, 8, 64), (5, 2, 64), (5, 2, 64)))
            q1, _, pools[layer][0], pools[layer][1] = kernel(q, k, v, pos, slots, *pools[layer], check_slots=False)
            q2, _, ref_pools[layer][0], ref_pools[layer][1] = rope_pool_fused_reference(
                q, k, v, pos, slots, *ref_pools[layer], rope=rope)
            outs += [q1, q2]
        mx.eval(outs, pools, ref_pools)  # one graph per step, as an engine evaluates it
    for (k1, v1), (k2, v2) in zip(pools, ref_pools):
        np.testing.assert_allclose(to_np(k1), to_np(k2), atol=6e-3)
        np.testing.assert_array_equal(to_np(v1), to_np(v2))


def test_zero_tokens_and_all_negative_slots(native_artifacts):
    kernel = native_kernel(RopeConfig(64))
    empty = make_case(0, 4, 2, 64, 4, "float32", [])
    out = kernel(*empty)
    assert out[0].shape == (0, 4, 64) and mx.array_equal(out[2], empty[5])
    no_rows = make_case(2, 4, 2, 64, 0, "float32", [0, 1], batch=2)   # head-major, 0 rows: nothing valid
    out = kernel(*no_rows, check_slots=False)
    assert out[2].shape == (2, 2, 0, 64)
    np.testing.assert_allclose(to_np(out[1]), rope_pool_numpy(*[to_np(a) for a in no_rows], RopeConfig(64))[1],
                               atol=TOL["float32"])
    args = make_case(3, 4, 2, 64, 4, "float32", [-1, -1, -1])
    before = np.array(args[5])
    out = kernel(*args)
    np.testing.assert_array_equal(np.array(out[2]), before)


def test_out_of_range_slots_never_written(native_artifacts):
    """With the per-call check off, slots >= pool size are skipped by the kernel itself."""
    kernel = native_kernel(RopeConfig(64))
    args = make_case(3, 4, 2, 64, 4, "float32", [4, 1000, 2])
    before = np.array(args[5])
    _, _, kp, _ = kernel(*args[:5], mx.array(args[5]), args[6], check_slots=False)
    np.testing.assert_array_equal(np.array(kp[[0, 1, 3]]), before[[0, 1, 3]])


def test_non_contiguous_inputs_are_made_contiguous(native_artifacts):
    rope = RopeConfig(32)
    kernel = native_kernel(rope)
    q, k, v, pos, slots, kp, vp = make_case(6, 4, 2, 32, 8, "float32", [0, 1, 2, 3, 4, 5])
    qt = mx.array(np.ascontiguousarray(np.array(q).transpose(1, 0, 2))).transpose(1, 0, 2)  # strided view
    got = kernel(qt, k, v, pos, slots, mx.array(kp), mx.array(vp))
    want = rope_pool_fused_reference(q, k, v, pos, slots, kp, vp, rope=rope)
    np.testing.assert_allclose(to_np(got[0]), to_np(want[0]), atol=3e-3)


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_device_indices_keep_values_and_shapes(backend):
    # "cuda" builds the device-buffer views on whatever device runs the test: values and shapes only.
    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    pos, slots, tab = device_indices(backend, (7,), [3], table)
    assert [pos.shape, slots.shape, tab.shape] == [(1,), (1,), (2, 3)]
    assert [pos.dtype, slots.dtype, tab.dtype] == [mx.int32] * 3
    assert pos.tolist() == [7] and slots.tolist() == [3] and tab.tolist() == table.tolist()


def test_lazy_1d_contiguous_inputs_go_as_they_are(native_artifacts):
    """The per-step index arrays of device_indices(backend="cuda") are lazy mx.contiguous views: the
    launcher adds no second Contiguous node per launch for them, and the kernel reads them right."""
    from benchmarks.graph_count import count

    rope = RopeConfig(32)
    kernel = native_kernel(rope)
    q, k, v, pos, slots, kp, vp = make_case(3, 4, 2, 32, 8, "float32", [5, 0, 2])
    pos_d, slots_d = device_indices("cuda", np.array(pos), np.array(slots))
    got = kernel(q, k, v, pos_d, slots_d, mx.array(kp), mx.array(vp), check_slots=False)
    assert count(got)["Contiguous"] == 2          # the two views' own, none added by the launch
    want = rope_pool_fused_reference(q, k, v, pos, slots, kp, vp, rope=rope)
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_np(g), to_np(w), atol=3e-5)
    lazy = mx.arange(3, dtype=mx.int32)[::-1] * 2     # a lazy view of another kind still gets one
    got = kernel(q, k, v, pos, lazy, mx.array(kp), mx.array(vp), check_slots=False)
    assert count(got)["Contiguous"] == 1


def test_disable_and_require_native(native_artifacts, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_AOT_DISABLE_NATIVE", "1")
    ctx = SelectionContext(attention="mha", rope=RopeConfig(64), rope_error="", n_heads=0, n_kv_heads=0,
                           head_dim=0, dtype=None, backend=backend_of(None))
    kernel = build(SPEC, ctx)
    assert kernel.implementation == "reference" and "MLX_AOT_DISABLE_NATIVE" in kernel.reason
    monkeypatch.delenv("MLX_AOT_DISABLE_NATIVE")
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(tmp_path))     # an empty artifact directory
    kernel = build(SPEC, ctx)
    assert kernel.implementation == "reference"
    assert "python -m build_tools compile --only rope_pool_fused" in kernel.reason
    monkeypatch.setenv("MLX_AOT_REQUIRE_NATIVE", "1")
    with pytest.raises(ArtifactError, match="MLX_AOT_REQUIRE_NATIVE is set"):
        build(SPEC, ctx)


def test_launcher_argument_errors(native_artifacts):
    from registry.errors import KernelArgumentError
    kernel = native_kernel(RopeConfig(64))
    launcher = kernel._launcher
    args = make_case(1, 2, 2, 64, 4, "float32", [0])
    inputs = dict(zip(("q", "k", "v", "positions", "slots", "k_pool", "v_pool"), args))
    with pytest.raises(KernelArgumentError, match="missing argument 'inv_freq'"):
        launcher.launch("float32", inputs, {}, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    inputs["inv_freq"] = mx.zeros((32,))
    with pytest.raises(KernelArgumentError, match="no entry for dtype int8"):
        launcher.launch("int8", inputs, {}, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    with pytest.raises(KernelArgumentError, match="missing scalar 'n_tokens'"):
        launcher.launch("float32", inputs, {}, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    scalars = dict.fromkeys([s.name for s in launcher.spec.signature.scalars], 1)
    bad = dict(inputs, k_pool=inputs["k_pool"].astype(mx.float16))
    with pytest.raises(ValueError, match="buffer 5 has dtype float16, the entry expects float32"):
        launcher.launch("float32", bad, scalars, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    bad = dict(inputs, slots=inputs["slots"].astype(mx.int64))
    with pytest.raises(ValueError, match="buffer 8 has dtype int64, the entry expects int32"):
        launcher.launch("float32", bad, scalars, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    with pytest.raises(TypeError, match=r"inputs\[0\] must be an mx.array"):
        launcher.run(launcher.plan("float32", scalars, grid=(1, 1, 1), threadgroup=(1, 1, 1)),
                     [np.zeros(2)] + [inputs[n] for n in launcher.input_names[1:]])
    for bad_scalars, message in ((dict(scalars, n_tokens=2.5), "scalar n_tokens must be an int32, got float 2.5"),
                                 (dict(scalars, n_tokens=True), "scalar n_tokens must be an int32, got bool"),
                                 (dict(scalars, n_tokens=2**31), "n_tokens=2147483648 does not fit in int32"),
                                 (dict(scalars, mscale=float("nan")), "scalar mscale=nan is not finite"),
                                 (dict(scalars, mscale="1"), "scalar mscale must be a float, got str")):
        with pytest.raises(KernelArgumentError, match=message):
            launcher.plan("float32", bad_scalars, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert launcher.plan("float32", dict(scalars, n_tokens=np.int64(3), pos_scale=np.float32(0.5)),
                         grid=(1, 1, 1), threadgroup=(1, 1, 1)).entry == "rope_pool_fused_f32"
    with pytest.raises(KernelArgumentError, match="scalar pos_scale=1e\\+40 does not fit in float32"):
        launcher.plan("float32", dict(scalars, pos_scale=1e40), grid=(1, 1, 1), threadgroup=(1, 1, 1))
    with pytest.raises(ValueError, match="threadgroup >= 1"):
        launcher.plan("float32", dict.fromkeys(launcher.spec.signature.scalars and
                                               [s.name for s in launcher.spec.signature.scalars], 1),
                      grid=(1, 1, 1), threadgroup=(0, 1, 1))


@pytest.mark.parametrize("make", ["zeros", "full", "concatenate", "index", "take_along_axis", "reshape"])
def test_a_fresh_lazy_pool_is_written_in_place_without_a_wait(native_artifacts, make):
    """A pool not computed yet whose evaluation allocates a buffer only it holds (mx.zeros,
    mx.full(shape, scalar), mx.concatenate: what the caches grow their buffers with; pool[indices] and
    mx.take_along_axis: mlx-lm's batch filter and roll; a reshape of one of them) is taken in place as
    it is: no wait, no first-use check, no copy, and every later call writes the same buffer."""
    from registry import native
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, slots, _, _ = make_case(2, 4, 2, 64, 8, "float32", [0, 1])
    mx.eval(q, k, v, pos, slots)
    half = mx.zeros((4, 2, 64))
    mx.eval(half)
    big = mx.zeros((16, 2, 64))
    mx.eval(big)
    rows = mx.arange(8, dtype=mx.int32)[:, None, None]
    fresh = {"zeros": lambda: mx.zeros((8, 2, 64)), "full": lambda: mx.full((8, 2, 64), 0.0),
             "concatenate": lambda: mx.concatenate([half, half]),
             "index": lambda: big[[1, 3, 5, 7, 9, 11, 13, 15]],                  # Squeeze(Gather)
             "take_along_axis": lambda: mx.take_along_axis(big, mx.broadcast_to(rows, (8, 2, 64)), axis=0),
             "reshape": lambda: mx.take(big.reshape(-1), mx.arange(8 * 2 * 64)).reshape(8, 2, 64)}[make]
    before = native.stats()
    _, _, kp, vp = kernel(q, k, v, pos, slots, fresh(), fresh())
    assert native.stats()["syncs"] == before["syncs"]            # decided before anything ran
    first = data_ptr(kp), data_ptr(vp)
    _, _, kp, vp = kernel(q, k, v, pos, slots + 2, kp, vp)
    assert (data_ptr(kp), data_ptr(vp)) == first
    after = native.stats()
    assert after["copies"] == before["copies"] and after["aliased"] - before["aliased"] == 4
    assert after["syncs"] == before["syncs"] and after["first_use_checks"] == before["first_use_checks"]
    np.testing.assert_array_equal(np.array(kp[2:4]), np.array(kernel(q, k, v, pos, slots, kp, vp)[1]))


def test_other_lazy_pools_are_computed_first_or_copied(native_artifacts):
    """A lazy pool of any other op (it may share a buffer, e.g. a view) is computed once and then
    decided like a computed one; a fresh one that a pending op still reads is copied."""
    from registry import native
    kernel = native_kernel(RopeConfig(64))
    q, k, v, pos, slots, _, _ = make_case(2, 4, 2, 64, 8, "float32", [0, 1])
    mx.eval(q, k, v, pos, slots)
    before = native.stats()
    _, _, kp, vp = kernel(q, k, v, pos, slots, mx.zeros((8, 2, 64)) + 1, mx.full((8, 2, 64), mx.zeros((8, 2, 64))))
    mx.eval(kp, vp)
    after = native.stats()
    assert after["syncs"] - before["syncs"] >= 2 and after["first_use_checks"] - before["first_use_checks"] == 2
    assert after["copies"] == before["copies"]
    np.testing.assert_array_equal(np.array(kp[2:]), np.ones((6, 2, 64), np.float32))
    big = mx.ones((16, 128))
    gathered = mx.take(big, mx.arange(8), axis=0)    # held here too: a Reshape of it is not fresh
    _, _, kp3, _ = kernel(q, k, v, pos, slots, gathered.reshape(8, 2, 64), mx.zeros((8, 2, 64)))
    mx.eval(kp3, gathered)
    assert native.stats()["copies"] == after["copies"] + 1
    np.testing.assert_array_equal(np.array(gathered), np.ones((8, 128), np.float32))
    after = native.stats()
    pool = mx.zeros((8, 2, 64))
    reader = pool * 2                                # pending: reads the old (zero) contents
    _, _, kp2, _ = kernel(q, k, v, pos, slots, pool, mx.zeros((8, 2, 64)))
    mx.eval(kp2, reader)
    assert native.stats()["copies"] == after["copies"] + 1
    np.testing.assert_array_equal(np.array(reader), np.zeros((8, 2, 64), np.float32))


def test_a_plan_launched_on_other_shapes_is_an_error(native_artifacts):
    """A plan's scalars and geometry are for one shape signature: run with other shapes (through
    the public raw launch) it would index out of bounds, so the launcher refuses, naming the input."""
    rope = RopeConfig(64)
    kernel = native_kernel(rope)
    decode = make_case(1, 4, 2, 64, 16, "float32", [3])
    prefill = make_case(8, 4, 2, 64, 16, "float32", list(range(8)))
    kernel(*prefill)
    (plan,) = kernel._plans.values()                  # the 8-token plan
    launch, binary = kernel._launch, kernel._binary
    with pytest.raises(ValueError, match=r"input 0 has shape 1x4x64, the plan was made for 8x4x64"):
        launch(binary, plan, kernel.launch_arrays(*decode), kernel.device)
