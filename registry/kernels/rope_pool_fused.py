"""rope_pool_fused: RoPE on q and k plus storing k and v into slot-indexed KV pools, one dispatch.

Contract (docs/kernel-abi.md):
    rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, rope)
        -> (q_rot, k_rot, k_pool, v_pool)
q [T, Hq, D], k and v [T, Hkv, D] of one float dtype (f16/bf16/f32), positions and slots int32 [T].
The pools (one shape, one float dtype, which may differ from q's: rows are converted on the store)
are slot-major [S, Hkv, D] (slot s is row s) or head-major [B, Hkv, S, D] (mlx-lm's KVCache
layout; slot = b * S + s), told apart by their rank.
The first `rope.rotary_dims` features rotate, the rest pass through (in the outputs and the pool).
slots[t] < 0 rotates only. check_slots=True (one host sync) refuses slots >= the pool's slot count
(S, or B * S), a valid slot given twice, and positions outside [0, 2^24]; with check_slots=False
the kernels still never write out of range, but which token's elements land on a repeated slot is
unspecified (each element is one of those tokens'), and any int32 position gives
angle = float(position) * pos_scale * inv_freq.
The pools come back updated; the native path updates them in place (the returned arrays share the
buffers passed in), so always rebind: `q, k, k_pool, v_pool = kernel(...)`.

This module is the kernel's thin wrapper (registry/kernels/_base.py has the rest): its argument
contract, the pure-MLX reference (the fallback and the oracle the native kernels are tested
against), launch geometry and scalars, and `build`, which the registry calls (kernels.yaml: wrapper).
"""

from __future__ import annotations

from ..core import SelectionContext
from ..rope import RopeConfig
from ._base import PoolGeometry, PoolKernel, act_scalars, from_rows, pool_dtype_key, rows_of, store_rows, to_rows
from ._rope import check_rope_args, inv_freq, rope_config, rope_scalars, rotate

KERNEL_NAME = "rope_pool_fused"
# The CUDA kernel's vector widths (elements); cuda_src/rope_pool_fused.cu switches on exactly these.
CUDA_WIDTHS = (8, 4, 2, 1)


# ----------------------------------------------------------------------------- launch geometry

def pick_heads_per_thread(n_q_heads: int, n_kv_heads: int, n_tokens: int) -> int:
    """Heads one thread rotates with one cos/sin computation. Small batches want every head on its
    own thread (latency); large ones amortise the trigonometry over 4 heads (the last group of a
    head count that 4 does not divide is partial: threads bound-check)."""
    del n_kv_heads
    return 1 if n_tokens * n_q_heads <= 4096 else 4


def head_groups(n_q_heads: int, n_kv_heads: int, heads_per_thread: int) -> int:
    """Thread groups of heads across q then k (the last of each partial when hpt does not divide)."""
    return -(-n_q_heads // heads_per_thread) + -(-n_kv_heads // heads_per_thread)


def metal_geometry(n_tokens: int, n_q_heads: int, n_kv_heads: int, head_dim: int, rotary_dims: int,
                   heads_per_thread: int, itemsize: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid in threads, threadgroup) for the Metal kernel; docs/kernel-abi.md spells it out."""
    del rotary_dims, itemsize  # every thread owns one feature pair; rotary vs pass-through is decided inside
    groups = head_groups(n_q_heads, n_kv_heads, heads_per_thread)
    gx = head_dim // 2
    tx = min(gx, 32)
    ty = max(1, min(n_tokens, 256 // tx))
    return (gx, max(n_tokens, 1), groups), (tx, ty, 1)


# Below this many threads a launch is bound by one thread's latency, not by memory: a decode step's
# few hundred threads would each compute W cos/sin in turn (ncu on the H200: 13 us per call at W = 8,
# e2e-root-cause.md), so the vector narrows and more threads share the rows.
LATENCY_THREADS = 4096


def _units(head_dim: int, rotary_dims: int, width: int) -> int:
    """Vector units of one row: rotary units (W pairs each), then pass-through units (W features)."""
    return rotary_dims // (2 * width) + (head_dim - rotary_dims) // width


def cuda_vector_width(head_dim: int, rotary_dims: int, itemsize: int, rows: int) -> int:
    """Elements per vector access of the CUDA kernel, passed to it as the scalar vec_width (the one
    source), for a launch of `rows` (tokens x head groups): 16 bytes of the activations' type when the
    rotary halves and the pass-through tail start on multiples of it (else narrower, down to 1),
    halved while the launch would have fewer than LATENCY_THREADS threads (a halved width still fits
    the row)."""
    w = 16 // itemsize
    while w > 1 and (rotary_dims % (2 * w) or (head_dim - rotary_dims) % w):
        w //= 2
    while w > 1 and rows * _units(head_dim, rotary_dims, w) < LATENCY_THREADS:
        w //= 2
    return w


def cuda_geometry(n_tokens: int, n_q_heads: int, n_kv_heads: int, head_dim: int, rotary_dims: int,
                  heads_per_thread: int, width: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid in threads, block) for the CUDA kernel: x = tokens x vector units of a row, y = head groups;
    blocks of up to 256 threads, no wider than x needs (whole warps), so a small launch's blocks hold
    no idle warps."""
    x = n_tokens * _units(head_dim, rotary_dims, width)
    groups = head_groups(n_q_heads, n_kv_heads, heads_per_thread)
    return (x, groups, 1), (min(256, max(32, -(-x // 32) * 32)), 1, 1)


# ----------------------------------------------------------------------------- kernel object

class RopePoolFusedKernel(PoolKernel):
    """What `KernelSet.rope` holds: call it like rope_pool_fused (without `rope=`)."""

    NAME = KERNEL_NAME
    ARGS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
    INPUTS = ("q", "k", "v", "k_pool", "v_pool", "positions", "slots", "inv_freq")
    POSITIONS = "positions"

    def __init__(self, rope: RopeConfig, **kw):
        super().__init__(rope, **kw)
        self.rope = rope
        self._inv_freq = inv_freq(rope)

    @classmethod
    def config_from(cls, ctx: SelectionContext) -> RopeConfig:
        return ctx.rope

    @classmethod
    def context_fields(cls, config: RopeConfig) -> dict:
        return dict(rope=config)

    def __repr__(self) -> str:
        return (f"RopePoolFusedKernel(rotary_dims={self.rope.rotary_dims}, traditional={self.rope.traditional}, "
                f"source={self.rope.source}, implementation={self.implementation})")

    def validate(self, q, k, v, positions, slots, k_pool, v_pool) -> None:
        check_rope_args(KERNEL_NAME, q, k, v, positions, slots, dict(k_pool=k_pool, v_pool=v_pool), self.rope)

    def reference(self, q, k, v, positions, slots, k_pool, v_pool):
        q_rot, k_rot = rotate(to_rows(q), positions, self.rope), rotate(to_rows(k), positions, self.rope)
        return (from_rows(q_rot, q), from_rows(k_rot, k), store_rows(k_pool, slots, k_rot),
                store_rows(v_pool, slots, to_rows(v)))

    def launch_config(self, q, k, v, positions, slots, k_pool, v_pool):
        T, Hq, D = rows_of(q)
        Hkv, R = k.shape[1], self.rope.rotary_dims
        hpt = pick_heads_per_thread(Hq, Hkv, T)
        width = cuda_vector_width(D, R, q.dtype.size, T * head_groups(Hq, Hkv, hpt)) if self.backend == "cuda" else 1
        if self.backend == "cuda":
            grid, group = cuda_geometry(T, Hq, Hkv, D, R, hpt, width)
        elif self.backend == "metal":
            grid, group = metal_geometry(T, Hq, Hkv, D, R, hpt, q.dtype.size)
        else:
            grid, group = (1, 1, 1), (1, 1, 1)
        scalars = dict(n_tokens=T, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D, heads_per_thread=hpt,
                       vec_width=width, **rope_scalars(self.rope), **PoolGeometry(k_pool).scalars, **act_scalars(q))
        return pool_dtype_key(q.dtype, k_pool.dtype), scalars, grid, group

    def launch_arrays(self, q, k, v, positions, slots, k_pool, v_pool):
        return [q, k, v, k_pool, v_pool, positions, slots, self._inv_freq]


build = RopePoolFusedKernel.build


def rope_pool_fused_reference(q, k, v, positions, slots, k_pool, v_pool, *, rope):
    """Pure-MLX rope_pool_fused: the kernels' fp32 rotation (their angles) + two scatters, lazily (no
    host sync). Runs on every MLX device, either pool layout, any float pool dtype; rows with slot < 0
    or >= pool size are not written."""
    kernel = RopePoolFusedKernel(rope_config(KERNEL_NAME, rope), backend="cpu")
    args = (q, k, v, positions, slots, k_pool, v_pool)
    kernel.validate(*args)
    return kernel.reference(*args)


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, rope, check_slots: bool = True):
    """Functional entry point: normalises `rope` (a RopeConfig or any supported RoPE module) and runs
    the native kernel for the default device when its artifact is available, else the reference."""
    return RopePoolFusedKernel.functional((q, k, v, positions, slots, k_pool, v_pool), rope_config(KERNEL_NAME, rope),
                                          check_slots=check_slots)
