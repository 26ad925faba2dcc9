"""GPU-only checks of the native rope_pool_fused (CUDA or Metal). The parity matrix and the in-place
tests of tests/test_native_rope_pool_fused.py run on the GPU too, since they use the default device."""

from __future__ import annotations


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


def test_fresh_outputs_live_in_device_memory(native_artifacts):
    """On CUDA the launcher's fresh outputs (rotated q and k) are device memory from the stream's pool,
    as MLX's own ops' outputs are, not managed memory (mx::allocator::malloc's); a host read still
    works (MLX moves the buffer to managed memory), and buffers freed either way are reused safely."""
    from registry import native

    if mx.default_device() != mx.gpu or not native.import_ext().built_with_cuda():
        pytest.skip("CUDA only: other backends have one kind of memory")
    ext = native.import_ext()
    rope = RopeConfig(64, base=1e4)
    kernel = native_kernel(rope)
    rng = np.random.default_rng(1)
    T, S = 4, 32
    kp, vp = mx.zeros((S, 2, 64), dtype=mx.bfloat16), mx.zeros((S, 2, 64), dtype=mx.bfloat16)
    for it in range(300):
        q = mx.array(rng.standard_normal((T, 8, 64)).astype(np.float32)).astype(mx.bfloat16)
        k = mx.array(rng.standard_normal((T, 2, 64)).astype(np.float32)).astype(mx.bfloat16)
        slots = mx.array(rng.permutation(S)[:T].astype(np.int32))
        pos = mx.array(rng.integers(0, 4096, T).astype(np.int32))
        q_rot, k_rot, kp, vp = kernel(q, k, k, pos, slots, kp, vp, check_slots=False)
        mx.eval(q_rot, k_rot, kp, vp)
        assert (ext.memory_kind(q_rot), ext.memory_kind(k_rot)) == ("device", "device"), f"iteration {it}"
        if it % 3 == 0:      # a host read of q_rot's own buffer: MLX moves it to managed memory; freeing it then must work
            want_q = rope_pool_fused_reference(q, k, k, pos, slots, kp, vp, rope=rope)[0].astype(mx.float32)
            bits = np.array(q_rot.view(mx.uint16)).astype(np.uint32) << 16       # NumPy has no bfloat16
            np.testing.assert_allclose(bits.view(np.float32), np.array(want_q), atol=0.05, rtol=0.02,
                                       err_msg=f"iteration {it}")
            assert ext.memory_kind(q_rot) == "managed"


def test_output_frees_beyond_the_cache_while_mlx_captures(native_artifacts):
    """More fresh outputs alive at once than the launcher's free list keeps (256 MiB): the rest are
    freed as they die, while MLX captures cuBLAS work on the same stream. A free enqueued on that
    stream would land in MLX's captured graph and abort the process (cudaGraphAddChildGraphNode:
    operation not supported), as it did in `bench --e2e` after llama-8b's batch-8 prefill."""
    from registry import native

    if mx.default_device() != mx.gpu or not native.import_ext().built_with_cuda():
        pytest.skip("CUDA only")
    rope = RopeConfig(128, base=1e4)
    kernel = native_kernel(rope)
    T, S = 8192, 8192
    q = mx.zeros((T, 32, 128), dtype=mx.bfloat16)             # 64 MiB of rotated q per launch
    k = mx.zeros((T, 8, 128), dtype=mx.bfloat16)
    a = mx.ones((512, 512), dtype=mx.bfloat16)
    slots = mx.arange(T, dtype=mx.int32)
    mx.eval(q, k, a, slots)
    for it in range(4):
        outs = []
        for _ in range(6):                                     # ~480 MiB of outputs alive together
            kp, vp = mx.zeros((S, 8, 128), dtype=mx.bfloat16), mx.zeros((S, 8, 128), dtype=mx.bfloat16)
            q_rot, k_rot, kp, vp = kernel(q, k, k, slots, slots, kp, vp, check_slots=False)
            outs.append((q_rot, k_rot))
        mx.eval(outs)
        del outs, q_rot, k_rot, kp, vp                         # freed by MLX's completion thread ...
        acc = a
        for _ in range(64):                                    # ... while matmuls are captured
            acc = (acc @ a) * (1 / 512)
            mx.eval(acc)
        assert float(acc[0, 0].item()) == pytest.approx(1.0), f"iteration {it}"


def test_the_output_free_list_keeps_the_sizes_in_use(native_artifacts):
    """After a prefill's outputs have filled the launcher's free list (256 MiB), decode-sized outputs
    still come from it: a full list frees the buffers given back longest ago. A list that kept its
    first buffers allocated every decode output anew (cudaMallocAsync) and freed it again."""
    from registry import native

    if mx.default_device() != mx.gpu or not native.import_ext().built_with_cuda():
        pytest.skip("CUDA only: other backends' outputs come from MLX's allocator")
    rope = RopeConfig(128, base=1e4)
    kernel = native_kernel(rope)

    def inputs(T):
        q = mx.zeros((T, 8, 128), dtype=mx.bfloat16)          # q and k of one size: T * 2 KiB each
        pos = mx.arange(T, dtype=mx.int32)
        kp, vp = mx.zeros((T, 8, 128), dtype=mx.bfloat16), mx.zeros((T, 8, 128), dtype=mx.bfloat16)
        mx.eval(q, pos, kp, vp)
        return q, pos, kp, vp

    q, pos, kp, vp = inputs(8192)
    prefill = []
    for _ in range(10):           # 20 outputs of 16 MiB alive together, then given back: the list is full
        q_rot, k_rot, kp, vp = kernel(q, q, q, pos, pos, kp, vp, check_slots=False)
        prefill += [q_rot, k_rot]
    mx.eval(prefill)
    del prefill, q_rot, k_rot, q, kp, vp
    mx.synchronize()
    q, pos, kp, vp = inputs(4)
    native.reset_stats()
    for _ in range(100):          # 200 decode-sized outputs, each dropped after its step
        q_rot, k_rot, kp, vp = kernel(q, q, q, pos, pos, kp, vp, check_slots=False)
        mx.eval(q_rot, k_rot)
        del q_rot, k_rot
    mx.synchronize()
    st = native.stats()
    # A few are allocated while the first ones are still in flight (MLX releases them when it likes).
    assert st["output_mallocs"] <= 50 and st["output_frees"] <= 50, st
