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
the kernels still never write out of range, but which token's row lands on a repeated slot is
unspecified, and any int32 position gives angle = float(position) * pos_scale * inv_freq.
The pools come back updated; the native path updates them in place (the returned arrays share the
buffers passed in), so always rebind: `q, k, k_pool, v_pool = kernel(...)`.

This module is the kernel's thin wrapper: argument validation, the pure-MLX reference (the fallback
and the oracle the native kernels are tested against), launch geometry, and `build`, which the
registry calls (kernels.yaml: wrapper).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import mlx.core as mx

from ..core import DTYPE_NAMES as _DTYPES
from ..core import SelectionContext, backend_of
from ..errors import KernelArgumentError
from ..rope import RopeConfig, UnsupportedRope, normalize_rope

log = logging.getLogger("registry")

KERNEL_NAME = "rope_pool_fused"


# ----------------------------------------------------------------------------- validation

def _shape(a: Any) -> str:
    return "x".join(str(s) for s in a.shape) if hasattr(a, "shape") else type(a).__name__


SLOT_MAJOR, HEAD_MAJOR = 0, 1   # the kernel's pool_layout scalar
_LAYOUTS = {3: ("slot-major", "[pool_size, n_kv_heads={Hkv}, head_dim={D}]"),
            4: ("head-major", "[batch, n_kv_heads={Hkv}, rows, head_dim={D}]")}


def pool_geometry(pool: mx.array) -> tuple[int, int, int]:
    """(pool_size = slots in all, pool_rows = rows per (batch, head), pool_layout) of a 3-D
    slot-major or 4-D head-major pool (validated)."""
    if pool.ndim == 3:
        return pool.shape[0], pool.shape[0], SLOT_MAJOR
    return pool.shape[0] * pool.shape[2], pool.shape[2], HEAD_MAJOR


def validate(q, k, v, positions, slots, k_pool, v_pool, rope: RopeConfig) -> None:
    """Raise KernelArgumentError naming the argument, the expectation and the shapes seen."""
    named = dict(q=q, k=k, v=v, positions=positions, slots=slots, k_pool=k_pool, v_pool=v_pool)
    for name, a in named.items():
        if not isinstance(a, mx.array):
            raise KernelArgumentError(f"rope_pool_fused: {name} must be an mx.array, got {type(a).__name__}")
    for name in ("q", "k", "v"):
        if named[name].ndim != 3:
            raise KernelArgumentError(f"rope_pool_fused: {name} must be 3-D [tokens, heads, head_dim], "
                                      f"got shape {_shape(named[name])}")
    for name in ("k_pool", "v_pool"):
        if named[name].ndim not in _LAYOUTS:
            raise KernelArgumentError(
                f"rope_pool_fused: {name} must be a slot-major [pool_size, n_kv_heads, head_dim] (3-D) or "
                f"head-major [batch, n_kv_heads, rows, head_dim] (4-D) pool, got shape {_shape(named[name])}")
    if q.dtype not in _DTYPES:
        raise KernelArgumentError(f"rope_pool_fused: q dtype {q.dtype} is not float16, bfloat16 or float32")
    for name in ("k", "v"):
        if named[name].dtype != q.dtype:
            raise KernelArgumentError(f"rope_pool_fused: {name} dtype {named[name].dtype} differs from "
                                      f"q dtype {q.dtype}; q, k and v must match")
    if k_pool.dtype not in _DTYPES:
        raise KernelArgumentError(f"rope_pool_fused: k_pool dtype {k_pool.dtype} is not float16, bfloat16 or "
                                  f"float32 (a pool may differ from q's dtype, but must be one of these)")
    if v_pool.dtype != k_pool.dtype:
        raise KernelArgumentError(f"rope_pool_fused: v_pool dtype {v_pool.dtype} differs from k_pool dtype "
                                  f"{k_pool.dtype}; the pools must match")
    T, Hq, D = q.shape
    if k.shape != v.shape:
        raise KernelArgumentError(f"rope_pool_fused: k {_shape(k)} and v {_shape(v)} must have the same shape")
    if k.shape[0] != T or k.shape[2] != D:
        raise KernelArgumentError(f"rope_pool_fused: k {_shape(k)} must be [tokens={T}, n_kv_heads, "
                                  f"head_dim={D}] to match q {_shape(q)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise KernelArgumentError(f"rope_pool_fused: q has {Hq} heads, not a multiple of k's {Hkv} heads")
    if D % 2:
        raise KernelArgumentError(f"rope_pool_fused: head_dim={D} must be even")
    for name in ("k_pool", "v_pool"):
        p = named[name]
        if p.shape[1] != Hkv or p.shape[-1] != D:
            layout, want = _LAYOUTS[p.ndim]
            raise KernelArgumentError(f"rope_pool_fused: {name} {_shape(p)}: a {layout} pool must be "
                                      + want.format(Hkv=Hkv, D=D))
    if k_pool.shape != v_pool.shape:
        raise KernelArgumentError(f"rope_pool_fused: k_pool {_shape(k_pool)} and v_pool {_shape(v_pool)} "
                                  f"must have the same shape")
    for name in ("positions", "slots"):
        a = named[name]
        if a.dtype != mx.int32 or a.shape != (T,):
            raise KernelArgumentError(f"rope_pool_fused: {name} must be int32 [tokens={T}], got "
                                      f"{a.dtype} {_shape(a)}")
    if rope.rotary_dims > D:
        raise KernelArgumentError(f"rope_pool_fused: rope.rotary_dims={rope.rotary_dims} exceeds head_dim={D}")
    size = pool_geometry(k_pool)[0]
    if size > INT32_MAX:
        raise KernelArgumentError(f"rope_pool_fused: k_pool {_shape(k_pool)} holds {size} slots, more than "
                                  f"INT32_MAX = {INT32_MAX}: slots and the kernel's pool_size are int32")


MAX_POSITION = 2**24   # fp32 angles of larger positions carry no meaningful fraction of a turn
INT32_MAX = 2**31 - 1


def validate_slots(slots: mx.array, pool_size: int, positions: mx.array | None = None) -> None:
    """Raise if any slot is >= pool_size, a valid slot repeats, or (given positions) a position is
    outside [0, 2^24]. Costs one host sync for all of it: engines call it once per step and pass
    check_slots=False to every layer (the kernels never write out of bounds regardless)."""
    if slots.size == 0:
        return
    valid = (slots >= 0) & (slots < pool_size)
    # Invalid slots become distinct negatives, so only valid repeats sort next to each other.
    keys = mx.sort(mx.where(valid, slots, -1 - mx.arange(slots.size, dtype=mx.int32)))
    checks = [mx.max(slots) >= pool_size, mx.any(keys[1:] == keys[:-1])]
    if positions is not None:
        checks += [mx.min(positions) < 0, mx.max(positions) > MAX_POSITION]
    out_of_range, repeated, *bad_positions = mx.stack(checks).tolist()
    if out_of_range:
        bad = int(mx.argmax(slots >= pool_size).item())
        raise KernelArgumentError(f"rope_pool_fused: slots[{bad}]={int(slots[bad].item())} "
                                  f"is out of range for a pool of {pool_size} slots (valid: 0..{pool_size - 1}, "
                                  f"or < 0 to skip the write)")
    if repeated:
        first: dict[int, int] = {}
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0 and slot in first:
                raise KernelArgumentError(f"rope_pool_fused: slots[{t}]={slot} repeats slots[{first[slot]}]: a "
                                          f"slot may be written once per call (unchecked, which token's row "
                                          f"lands is unspecified)")
            first.setdefault(slot, t)
    if any(bad_positions):
        p = positions.tolist()
        t = next(i for i, x in enumerate(p) if not 0 <= x <= MAX_POSITION)
        raise KernelArgumentError(f"rope_pool_fused: positions[{t}]={p[t]} is outside [0, 2^24 = {MAX_POSITION}]: "
                                  f"fp32 RoPE angles are meaningless beyond (unchecked, every path computes "
                                  f"float(position) * pos_scale * inv_freq all the same)")


# ----------------------------------------------------------------------------- reference

def _rotate(x: mx.array, positions: mx.array, rope: RopeConfig) -> mx.array:
    """x [T, H, D] -> rotated, fp32 math, rounded once to x.dtype. The angles are the kernels' own
    (docs/kernel-abi.md): float32(position) * pos_scale * inv_freq[i] in fp32, with the float32
    inv_freq the kernels get, so every path agrees at any int32 position, negative ones included."""
    r, half = rope.rotary_dims, rope.rotary_dims // 2
    x32 = x.astype(mx.float32)
    angle = (positions.astype(mx.float32) * rope.pos_scale)[:, None] * _inv_freq(rope)[None]   # [T, r/2]
    c, s = mx.cos(angle)[:, None, :], mx.sin(angle)[:, None, :]
    if rope.traditional:
        x1, x2 = x32[..., 0:r:2] * rope.mscale, x32[..., 1:r:2] * rope.mscale
        rot = mx.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(*x.shape[:-1], r)
    else:
        x1, x2 = x32[..., :half] * rope.mscale, x32[..., half:r] * rope.mscale
        rot = mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    if r < x.shape[-1]:
        rot = mx.concatenate([rot, x32[..., r:]], axis=-1)   # pass-through features, exact
    return rot.astype(x.dtype)


@functools.lru_cache(maxsize=64)
def _inv_freq(rope: RopeConfig) -> mx.array:
    return mx.array(rope.inv_freq())


def _store(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """pool with slot slots[t] = rows[t] [Hkv, D] where slots[t] is in range, lazily (no host sync),
    for either pool layout: one scatter of head rows into the pool seen as [rows, D].

    Rows whose slot must not be written are redirected to repeat a valid token's write (identical
    value, so duplicate indices cannot conflict); with no valid token at all, slot 0 gets its own value.
    """
    size, S, layout = pool_geometry(pool)
    Hkv, D = pool.shape[1], pool.shape[-1]
    if slots.size == 0 or size == 0 or Hkv == 0:
        return mx.array(pool)
    valid = (slots >= 0) & (slots < size)
    j = mx.argmax(valid)
    any_valid = valid[j]
    idx = mx.where(valid, slots, mx.where(any_valid, slots[j], 0)).astype(mx.int64)  # 64-bit row indices
    h = mx.arange(Hkv, dtype=mx.int64)[None]
    if layout == SLOT_MAJOR:
        flat_rows = idx[:, None] * Hkv + h
    else:
        flat_rows = ((idx // S)[:, None] * Hkv + h) * S + (idx % S)[:, None]
    out = pool.reshape(-1, D)  # a new array object: the caller's pool object is left as it was
    fallback = mx.where(any_valid, rows[j].astype(pool.dtype)[None], out[flat_rows])  # no valid token: identity
    vals = mx.where(valid[:, None, None], rows.astype(pool.dtype), fallback)
    out[flat_rows.reshape(-1)] = vals.reshape(-1, D)
    return out.reshape(pool.shape)


def rope_pool_fused_reference(q, k, v, positions, slots, k_pool, v_pool, *, rope):
    """Pure-MLX rope_pool_fused: the kernels' fp32 rotation (their angles) + two scatters, lazily (no
    host sync). Runs on every MLX device, either pool layout, any float pool dtype; rows with slot < 0
    or >= pool size are not written."""
    rope = normalize_rope(rope)
    validate(q, k, v, positions, slots, k_pool, v_pool, rope)
    q_rot = _rotate(q, positions, rope)
    k_rot = _rotate(k, positions, rope)
    return q_rot, k_rot, _store(k_pool, slots, k_rot), _store(v_pool, slots, v)


# ----------------------------------------------------------------------------- launch geometry

def pick_heads_per_thread(n_q_heads: int, n_kv_heads: int, n_tokens: int) -> int:
    """Heads one thread rotates with one cos/sin computation. Small batches want every head on its
    own thread (latency); large ones amortise the trigonometry over 4 heads (the last group of a
    head count that 4 does not divide is partial: threads bound-check)."""
    del n_kv_heads
    return 1 if n_tokens * n_q_heads <= 4096 else 4


def metal_geometry(n_tokens: int, n_q_heads: int, n_kv_heads: int, head_dim: int, rotary_dims: int,
                   heads_per_thread: int, itemsize: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid in threads, threadgroup) for the Metal kernel; docs/kernel-abi.md spells it out."""
    del rotary_dims, itemsize  # every thread owns one feature pair; rotary vs pass-through is decided inside
    hpt = heads_per_thread
    groups = -(-n_q_heads // hpt) + -(-n_kv_heads // hpt)
    gx = head_dim // 2
    tx = min(gx, 32)
    ty = max(1, min(n_tokens, 256 // tx))
    return (gx, max(n_tokens, 1), groups), (tx, ty, 1)


def cuda_vector_width(head_dim: int, rotary_dims: int, itemsize: int) -> int:
    """Elements per vector access of the CUDA kernel (its pick_width): 16 bytes when the rotary halves
    and the pass-through tail start on multiples of it, else narrower, down to 1."""
    w = 16 // itemsize
    while w > 1:
        if rotary_dims % (2 * w) == 0 and (head_dim - rotary_dims) % w == 0:
            return w
        w //= 2
    return 1


def cuda_geometry(n_tokens: int, n_q_heads: int, n_kv_heads: int, head_dim: int, rotary_dims: int,
                  heads_per_thread: int, itemsize: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid in threads, block) for the CUDA kernel: x = tokens x vector units of a row, y = head groups."""
    w = cuda_vector_width(head_dim, rotary_dims, itemsize)
    units = rotary_dims // (2 * w) + (head_dim - rotary_dims) // w
    hpt = heads_per_thread
    groups = -(-n_q_heads // hpt) + -(-n_kv_heads // hpt)
    return (n_tokens * units, groups, 1), (256, 1, 1)


_GEOMETRY = {"metal": metal_geometry, "cuda": cuda_geometry}
_REFERENCE = object()  # the plan of a kernel object without a native launcher


# ----------------------------------------------------------------------------- kernel object

class RopePoolFusedKernel:
    """What `KernelSet.rope` holds: call it like rope_pool_fused (without `rope=`).

    `implementation` says what runs: 'native-cuda', 'native-metal', 'native-cpu' or 'reference';
    `reason` says why (e.g. which artifact was loaded, or why the native path is unavailable).
    """

    # The signature's inputs in launch order (kernels.yaml: buffers with role input or inplace).
    _INPUTS = ("q", "k", "v", "k_pool", "v_pool", "positions", "slots", "inv_freq")

    def __init__(self, rope: RopeConfig, *, backend: str, device: mx.Device | None = None,
                 launcher: Any = None, reason: str = ""):
        self.rope = rope
        self.backend = backend
        self.device = device
        self._launcher = launcher
        self.reason = reason
        self._inv_freq = _inv_freq(rope)
        self._plans: dict[tuple, tuple] = {}
        self.enabled = True
        if launcher is not None:
            if launcher.input_names != self._INPUTS:
                raise KernelArgumentError(f"rope_pool_fused: kernels.yaml signature inputs {launcher.input_names} "
                                          f"differ from the wrapper's {self._INPUTS}")
            self._launch, self._binary = launcher.raw_launch

    @property
    def implementation(self) -> str:
        return f"native-{self.backend}" if self._launcher is not None else "reference"

    def __repr__(self) -> str:
        return (f"RopePoolFusedKernel(rotary_dims={self.rope.rotary_dims}, traditional={self.rope.traditional}, "
                f"source={self.rope.source}, implementation={self.implementation})")

    def _plan(self, q, k, k_pool) -> tuple:
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        hpt = pick_heads_per_thread(Hq, Hkv, T)
        geometry = _GEOMETRY.get(self.backend)
        grid, group = (geometry(T, Hq, Hkv, D, self.rope.rotary_dims, hpt, q.dtype.size) if geometry
                       else ((1, 1, 1), (1, 1, 1)))
        pool_size, pool_rows, pool_layout = pool_geometry(k_pool)
        scalars = dict(n_tokens=T, pool_size=pool_size, pool_rows=pool_rows, n_q_heads=Hq, n_kv_heads=Hkv,
                       head_dim=D, rotary_dims=self.rope.rotary_dims, traditional=int(self.rope.traditional),
                       heads_per_thread=hpt, pos_scale=self.rope.pos_scale, mscale=self.rope.mscale,
                       pool_layout=pool_layout)
        act, pool = _DTYPES[q.dtype], _DTYPES[k_pool.dtype]
        return self._launcher.plan(act if act == pool else f"{act}/{pool}", scalars, grid=grid, threadgroup=group)

    def __call__(self, q, k, v, positions, slots, k_pool, v_pool, *, check_slots: bool = True):
        # Hot path: one dict lookup on the shape/dtype signature, then one extension call.
        try:
            key = (q.shape, k.shape, v.shape, k_pool.shape, v_pool.shape, positions.shape, slots.shape,
                   q.dtype, k.dtype, v.dtype, k_pool.dtype, v_pool.dtype, positions.dtype, slots.dtype)
        except AttributeError:
            key = None
        plan = self._plans.get(key)
        if plan is None:
            # Full validation once per shape signature; later calls with the same shapes reuse it.
            validate(q, k, v, positions, slots, k_pool, v_pool, self.rope)
            plan = self._plan(q, k, k_pool) if self._launcher is not None else _REFERENCE
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan
        if check_slots:
            validate_slots(slots, pool_geometry(k_pool)[0], positions)
        if plan is _REFERENCE:
            return rope_pool_fused_reference(q, k, v, positions, slots, k_pool, v_pool, rope=self.rope)
        q_rot, k_rot, k_pool, v_pool = self._launch(
            self._binary, plan, [q, k, v, k_pool, v_pool, positions, slots, self._inv_freq], self.device)
        return q_rot, k_rot, k_pool, v_pool


def build(spec, ctx) -> RopePoolFusedKernel:
    """Registry hook (kernels.yaml `wrapper`): a kernel object for the selection context `ctx`,
    native when the artifact for ctx.backend is present and fresh, else the reference path."""
    from ..native import load_launcher  # the native side is optional: import only when building

    launcher, reason = load_launcher(spec, ctx.backend)
    if launcher is None:
        log.debug("rope_pool_fused: native path unavailable on %s: %s", ctx.backend, reason)
    return RopePoolFusedKernel(ctx.rope, backend=ctx.backend, device=ctx.device, launcher=launcher,
                               reason=reason)


@functools.lru_cache(maxsize=32)
def _default_kernel(rope: RopeConfig, backend: str) -> RopePoolFusedKernel:
    from ..manifest import load_manifest

    spec = load_manifest().kernel(KERNEL_NAME)
    ctx = SelectionContext(attention="mha", rope=rope, rope_error="", n_heads=0, n_kv_heads=0, head_dim=0,
                           dtype=None, backend=backend, device=None)
    return build(spec, ctx)


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, rope, check_slots: bool = True):
    """Functional entry point: normalises `rope` (a RopeConfig or any supported RoPE module) and runs
    the native kernel for the default device when its artifact is available, else the reference."""
    try:
        cfg = normalize_rope(rope)
    except UnsupportedRope as e:
        raise KernelArgumentError(f"rope_pool_fused: rope: {e}") from None
    validate(q, k, v, positions, slots, k_pool, v_pool, cfg)  # argument errors before any manifest work
    kernel = _default_kernel(cfg, backend_of())
    return kernel(q, k, v, positions, slots, k_pool, v_pool, check_slots=check_slots)
