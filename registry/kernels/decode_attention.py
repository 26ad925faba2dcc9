"""decode_attention: a few query tokens per sequence attending over K/V read in place.

Contract (docs/kernel-abi.md):
    decode_attention(q, k_pool, v_pool, kv_len, kv_end=None, table=None, *, scale, window=0,
                     softcap=0.0) -> out
q [B, Hq, L, D] (any strides; L <= 8), out [B, Hq, L, D] of q's dtype. The pools are q's dtype and
either mlx-lm's head-major cache buffers [B, Hkv, S, D] or a slot-major pool [P, Hkv, D] with a slot
table int32 [B, M]. Row b has n_b = clamp(kv_len[b], 0, S or M) valid keys, logical i in [0, n_b):
head-major, key i is buffer row (kv_end[b] - n_b + i) mod S (kv_end: one past the newest row; ring
buffers wrap); slot-major, key i is slot table[b, i] (a slot outside the pool is never read). Query l
sees keys i <= n_b - L + l, and i > n_b - L + l - window when window > 0. No copy, no gather, no mask.

The CUDA kernel splits long rows across blocks (flash-decoding) into a workspace that this module
owns, one per backend for every kernel object (launches on one stream run in order), updated in
place like a pool: callers never see it.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ._base import INT32_MAX, PoolKernel, check_arrays, shape_str
from ..core import DTYPE_NAMES
from ..errors import KernelArgumentError

KERNEL_NAME = "decode_attention"
MAX_QUERY = 8                 # query tokens per sequence (decode, speculative verification)
MAX_HEAD_DIM = 256
CUDA_THREADS = 128            # cuda_src/decode_attention.cu THREADS
CUDA_SMS = 132                # H100/H200 SXM
MAX_SPLITS = 128              # cuda_src/decode_attention.cu MAX_SPLITS
MIN_SPLIT = 256               # keys per split at least (a split's fixed cost: its partials and merge)
HEAD_MAJOR, SLOT_MAJOR = 1, 0


def cuda_slots(dtype) -> int:
    """Resident blocks of the CUDA kernels for activations of `dtype`: blocks per SM as built
    (cuda_src/aot_attention.cuh blocks_per_sm: 2 for 2-byte types, whose tensor-core path needs the
    registers, 3 for float32) x CUDA_SMS."""
    return CUDA_SMS * (2 if dtype.size == 2 else 3)


def split_plan(rows: int, batch: int, n_kv_heads: int, backend: str, slots: int = CUDA_SMS * 3) -> tuple[int, int]:
    """(n_splits, split_len) for a row capacity of `rows` keys: the blocks (batch x kv heads x splits)
    fill whole waves of `slots` resident blocks (cuda_slots) as nearly as possible (a ragged last wave
    idles the rest of the GPU), with the fewest splits within 3% of the best fill, each split at least
    MIN_SPLIT keys. One split off CUDA (the CPU and Metal entries run each row whole). The one source
    of the split: the kernel checks n_splits * split_len >= rows."""
    if backend != "cuda" or rows <= MIN_SPLIT:
        return 1, max(rows, 1)
    base = max(batch * n_kv_heads, 1)
    fill = {s: base * s / (-(-base * s // slots) * slots)
            for s in range(1, min(MAX_SPLITS, -(-rows // MIN_SPLIT)) + 1)}
    best = max(fill.values())
    splits = min(s for s, f in fill.items() if f >= best - 0.03)
    split_len = -(-rows // splits)
    return -(-rows // split_len), split_len


class _Scratch:
    """The CUDA workspace and locks shared by every launch on one backend, grown to the largest need.
    Rebound after each launch (in-place outputs), like a pool."""

    def __init__(self):
        self.workspace = mx.zeros((1,), dtype=mx.float32)
        self.locks = mx.zeros((1,), dtype=mx.int32)

    def fit(self, floats: int, counters: int) -> None:
        if floats > self.workspace.size:
            self.workspace = mx.zeros((1 << (floats - 1).bit_length(),), dtype=mx.float32)
        if counters > self.locks.size:
            self.locks = mx.zeros((1 << (counters - 1).bit_length(),), dtype=mx.int32)


_SCRATCH: dict[str, _Scratch] = {}
_NO_TABLE: dict[str, mx.array] = {}


def _no_table(backend: str) -> mx.array:
    """The 1-element table a head-major call passes (never read)."""
    t = _NO_TABLE.get(backend)
    if t is None:
        t = _NO_TABLE[backend] = mx.zeros((4,), dtype=mx.int32)[:1]
        mx.eval(t)
    return t


def _check_scalars(scale, window, softcap) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise KernelArgumentError(f"decode_attention: scale must be a finite number, got {scale!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= INT32_MAX:
        raise KernelArgumentError(f"decode_attention: window must be an int in [0, {INT32_MAX}] (0: no window), "
                                  f"got {window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
            or softcap < 0:
        raise KernelArgumentError(f"decode_attention: softcap must be a finite number >= 0 (0: none), got {softcap!r}")


def check_queries(kernel: str, q, scale, window, softcap) -> tuple[int, int, int, int]:
    """q [B, Hq, L <= 8, D] of a float dtype, D a multiple of 8 up to 256, and the scalars; its shape."""
    _check_scalars(scale, window, softcap)
    if q.ndim != 4:
        raise KernelArgumentError(f"{kernel}: q must be 4-D [batch, n_q_heads, L, head_dim], got shape {shape_str(q)}")
    if q.dtype not in DTYPE_NAMES:
        raise KernelArgumentError(f"{kernel}: q dtype {q.dtype} is not float16, bfloat16 or float32")
    B, Hq, L, D = q.shape
    if not 1 <= L <= MAX_QUERY:
        raise KernelArgumentError(f"{kernel}: q has L={L} query tokens per sequence; the kernel takes "
                                  f"1 to {MAX_QUERY} (decode and speculative verification; prefill: MLX's sdpa)")
    if D % 8 or not 8 <= D <= MAX_HEAD_DIM:
        raise KernelArgumentError(f"{kernel}: head_dim={D} (q {shape_str(q)}): the kernel takes a "
                                  f"multiple of 8 up to {MAX_HEAD_DIM}")
    return B, Hq, L, D


def check_rows(kernel: str, kv_len, kv_end, table, B: int, slot_major: bool) -> None:
    """kv_len and kv_end int32 [B]; a slot-major pool's table int32 [B, max_keys], a head-major's None."""
    for name, a in (("kv_len", kv_len), ("kv_end", kv_end)):
        if a.dtype != mx.int32 or tuple(a.shape) != (B,):
            raise KernelArgumentError(f"{kernel}: {name} must be int32 [batch={B}], got {a.dtype} {shape_str(a)}")
    if slot_major:
        if not isinstance(table, mx.array) or table.dtype != mx.int32 or table.ndim != 2 or table.shape[0] != B:
            got = f"{table.dtype} {shape_str(table)}" if isinstance(table, mx.array) else repr(table)
            raise KernelArgumentError(f"{kernel}: a slot-major pool needs table, int32 [batch={B}, "
                                      f"max_keys] of slots, got {got}")
    elif table is not None and not (isinstance(table, mx.array) and table.size <= 1):
        raise KernelArgumentError(f"{kernel}: a head-major pool reads its rows through kv_len and "
                                  f"kv_end; table must be None, got {shape_str(table)}")


class DecodeAttentionKernel(PoolKernel):
    NAME = KERNEL_NAME
    ARGS = ("q", "k_pool", "v_pool", "kv_len", "kv_end", "table")
    INPUTS = ("q", "k_pool", "v_pool", "kv_len", "kv_end", "table", "workspace", "locks")
    SLOTS, POOL = None, "k_pool"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._last: tuple | None = None          # (key, plan, scratch sizes): steady calls skip the lookup

    # -- the contract
    def validate(self, q, k_pool, v_pool, kv_len, kv_end, table, scale=1.0, window=0, softcap=0.0) -> None:
        check_arrays(KERNEL_NAME, dict(q=q, k_pool=k_pool, v_pool=v_pool, kv_len=kv_len, kv_end=kv_end))
        B, Hq, L, D = check_queries(KERNEL_NAME, q, scale, window, softcap)
        for name, p in (("k_pool", k_pool), ("v_pool", v_pool)):
            if p.ndim not in (3, 4):
                raise KernelArgumentError(f"decode_attention: {name} must be head-major [batch, n_kv_heads, rows, "
                                          f"head_dim] (4-D) or slot-major [pool_size, n_kv_heads, head_dim] (3-D), "
                                          f"got shape {shape_str(p)}")
            if p.dtype != q.dtype:
                raise KernelArgumentError(f"decode_attention: {name} dtype {p.dtype} differs from q dtype {q.dtype}; "
                                          f"the kernel reads pools of the activations' dtype")
        if k_pool.shape != v_pool.shape:
            raise KernelArgumentError(f"decode_attention: k_pool {shape_str(k_pool)} and v_pool "
                                      f"{shape_str(v_pool)} must have the same shape")
        Hkv = k_pool.shape[-2] if k_pool.ndim == 3 else k_pool.shape[1]
        if k_pool.shape[-1] != D:
            raise KernelArgumentError(f"decode_attention: k_pool {shape_str(k_pool)} rows have "
                                      f"{k_pool.shape[-1]} features, q {shape_str(q)} has head_dim {D}")
        if Hkv < 1 or Hq % Hkv:
            raise KernelArgumentError(f"decode_attention: n_q_heads={Hq} (q) is not a multiple of n_kv_heads={Hkv} "
                                      f"(k_pool {shape_str(k_pool)})")
        if k_pool.ndim == 4 and k_pool.shape[0] != B:
            raise KernelArgumentError(f"decode_attention: a head-major k_pool {shape_str(k_pool)} must have q's "
                                      f"batch {B}")
        if k_pool.size > 0 and (k_pool.shape[-3] if k_pool.ndim == 3 else k_pool.shape[2]) > INT32_MAX:
            raise KernelArgumentError(f"decode_attention: k_pool {shape_str(k_pool)} has more than INT32_MAX rows")
        check_rows(KERNEL_NAME, kv_len, kv_end, table, B, k_pool.ndim == 3)

    def check_values(self, q, k_pool, v_pool, kv_len, kv_end, table) -> None:
        """Valid ranges inside the pool and table entries in range, in one host sync (check=True)."""
        rows = table.shape[1] if k_pool.ndim == 3 else k_pool.shape[2]
        checks = [mx.min(kv_len) < 0, mx.max(kv_len) > rows]
        if k_pool.ndim == 4:
            checks += [mx.min(kv_end) < 0, mx.max(kv_end) > rows]
        else:
            used = mx.arange(rows)[None] < kv_len[:, None]
            checks.append(mx.any(used & ((table < 0) | (table >= k_pool.shape[0]))))
        bad = mx.stack(checks).tolist()
        if bad[0] or bad[1]:
            b = int(mx.argmax((kv_len < 0) | (kv_len > rows)).item())
            raise KernelArgumentError(f"decode_attention: kv_len[{b}]={int(kv_len[b].item())} is outside [0, {rows}] "
                                      f"(the {'table' if k_pool.ndim == 3 else 'cache'} holds {rows} keys per row)")
        if k_pool.ndim == 4 and (bad[2] or bad[3]):
            b = int(mx.argmax((kv_end < 0) | (kv_end > rows)).item())
            raise KernelArgumentError(f"decode_attention: kv_end[{b}]={int(kv_end[b].item())} is outside [0, {rows}] "
                                      f"(one past the newest row of a cache of {rows} rows)")
        if k_pool.ndim == 3 and bad[2]:
            t = table.tolist()
            n = kv_len.tolist()
            b, i = next((b, i) for b in range(len(t)) for i in range(n[b]) if not 0 <= t[b][i] < k_pool.shape[0])
            raise KernelArgumentError(f"decode_attention: table[{b}, {i}]={t[b][i]} points outside the pool of "
                                      f"{k_pool.shape[0]} slots (valid: 0..{k_pool.shape[0] - 1})")

    def reference(self, q, k_pool, v_pool, kv_len, kv_end, table, scale=1.0, window=0, softcap=0.0):
        """Pure MLX: the keys gathered per row by the contract's index map, fp32 softmax."""
        kv_end = kv_len if kv_end is None else kv_end
        B, Hq, L, D = q.shape
        if k_pool.ndim == 4:
            Hkv, rows = k_pool.shape[1], k_pool.shape[2]
            n = mx.clip(kv_len, 0, rows)
            i = mx.arange(rows)
            phys = (kv_end[:, None] - n[:, None] + i[None]) % max(rows, 1)
            keys = mx.take_along_axis(k_pool, phys[:, None, :, None], axis=2)
            vals = mx.take_along_axis(v_pool, phys[:, None, :, None], axis=2)
            ok = i[None] < n[:, None]
        else:
            Hkv, rows = k_pool.shape[1], table.shape[1]
            n = mx.clip(kv_len, 0, rows)
            i = mx.arange(rows)
            inside = (table >= 0) & (table < k_pool.shape[0])
            slots = mx.where(inside, table, 0)
            keys = k_pool[slots].transpose(0, 2, 1, 3)
            vals = v_pool[slots].transpose(0, 2, 1, 3)
            ok = inside & (i[None] < n[:, None])
        G = Hq // Hkv
        hi = n[:, None, None] - L + mx.arange(L)[None, :, None]                         # [B, L, 1]
        see = ok[:, None, :] & (i[None, None] <= hi)
        if window > 0:
            see = see & (i[None, None] > hi - window)
        qf = q.astype(mx.float32).reshape(B, Hkv, G, L, D) * scale
        s = qf @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)                  # [B, Hkv, G, L, rows]
        if softcap > 0:
            s = softcap * mx.tanh(s / softcap)
        see = see[:, None, None]
        s = mx.where(see, s, -mx.inf)
        m = mx.max(s, axis=-1, keepdims=True)
        p = mx.where(see, mx.exp(s - mx.where(mx.isinf(m), 0, m)), 0)
        denom = mx.sum(p, axis=-1, keepdims=True)
        o = (p @ vals.astype(mx.float32)[:, :, None]) / mx.where(denom > 0, denom, 1)
        return o.reshape(B, Hq, L, D).astype(q.dtype)

    def launch_config(self, q, k_pool, v_pool, kv_len, kv_end, table, scale=1.0, window=0, softcap=0.0):
        B, Hq, L, D = q.shape
        head_major = k_pool.ndim == 4
        Hkv = k_pool.shape[1]
        rows = k_pool.shape[2] if head_major else table.shape[1]
        splits, split_len = split_plan(rows, B, Hkv, self.backend, cuda_slots(q.dtype))
        scalars = dict(batch=B, seq_len=L, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D,
                       pool_layout=HEAD_MAJOR if head_major else SLOT_MAJOR,
                       pool_rows=k_pool.shape[2] if head_major else k_pool.shape[0],
                       table_cols=0 if head_major else table.shape[1], window=window, scale=float(scale),
                       softcap=float(softcap), n_splits=splits, split_len=split_len)
        if self.backend == "cuda":        # block (split, kv head, batch row)
            grid, group = (splits * CUDA_THREADS, Hkv, B), (CUDA_THREADS, 1, 1)
        elif self.backend == "metal":     # a threadgroup of 32 per query row
            grid, group = (32, Hq * L, B), (32, 1, 1)
        else:
            grid, group = (1, 1, 1), (1, 1, 1)
        return DTYPE_NAMES[q.dtype], scalars, grid, group

    def scratch_need(self, q, k_pool, table) -> tuple[int, int]:
        """(workspace floats, lock counters) one launch needs."""
        B, Hq, L, D = q.shape
        Hkv = k_pool.shape[1]
        rows = k_pool.shape[2] if k_pool.ndim == 4 else table.shape[1]
        splits, _ = split_plan(rows, B, Hkv, self.backend, cuda_slots(q.dtype))
        return (B * Hq * L * splits * (D + 2) if splits > 1 else 1), B * Hkv

    # -- calls
    def __call__(self, q, k_pool, v_pool, kv_len, kv_end=None, table=None, scale=None, window: int = 0,
                 softcap: float = 0.0, *, check: bool = True):
        """`out` [B, Hq, L, D]. check=True also checks the valid ranges and table entries (one host
        sync); the kernel never reads outside the pool or table regardless."""
        if scale is None:
            raise KernelArgumentError("decode_attention: scale is required (the attention's softmax scale, "
                                      "e.g. head_dim ** -0.5)")
        kv_end = kv_len if kv_end is None else kv_end
        if self._launcher is None:
            self.validate(q, k_pool, v_pool, kv_len, kv_end, table, scale, window, softcap)
            if check:
                self.check_values(q, k_pool, v_pool, kv_len, kv_end, table)
            return self.reference(q, k_pool, v_pool, kv_len, kv_end, table, scale, window, softcap)
        given, table = table, (_no_table(self.backend) if table is None else table)
        scratch = _SCRATCH.get(self.backend)
        if scratch is None:
            scratch = _SCRATCH[self.backend] = _Scratch()
        try:
            key = (q.shape, q.dtype, *self.pool_key(k_pool), *self.pool_key(v_pool), kv_len.shape,
                   kv_end.shape, kv_len.dtype, kv_end.dtype, table.shape, table.dtype, scale, window, softcap)
        except AttributeError:
            key = None
        last = self._last
        if key is None or last is None or last[0] != key or last[2] != (scratch.workspace.size, scratch.locks.size):
            self.validate(q, k_pool, v_pool, kv_len, kv_end, given, scale, window, softcap)
            scratch.fit(*self.scratch_need(q, k_pool, table))
            dkey, scalars, grid, group = self.launch_config(q, k_pool, v_pool, kv_len, kv_end, table, scale, window,
                                                            softcap)
            arrays = self.launch_arrays(q, k_pool, v_pool, kv_len, kv_end, table)
            plan = self._launcher.plan(dkey, scalars, grid=grid, threadgroup=group,
                                       input_shapes=[a.shape for a in arrays])
            last = self._last = (key, plan, (scratch.workspace.size, scratch.locks.size))
        if check:
            self.check_values(q, k_pool, v_pool, kv_len, kv_end, table)
        out, scratch.workspace, scratch.locks = self._launch(
            self._binary, last[1], self.launch_arrays(q, k_pool, v_pool, kv_len, kv_end, table), self.device)
        return out

    # A side's pool as the kernel takes it: one array here, a group of them in a subclass (the
    # quantized kernel's words, scales and biases).
    def pool_key(self, pool) -> tuple:
        return pool.shape, pool.dtype

    def pool_arrays(self, pool) -> tuple:
        return (pool,)

    def launch_arrays(self, q, k_pool, v_pool, kv_len, kv_end, table, *_):
        scratch = _SCRATCH[self.backend]
        return [q, *self.pool_arrays(k_pool), *self.pool_arrays(v_pool), kv_len, kv_end, table, scratch.workspace,
                scratch.locks]

    def bind(self, *args):
        raise NotImplementedError("decode_attention: call the kernel object (its last plan is kept per object)")

    last_bound = bind

    @classmethod
    def functional(cls, args: tuple, config=None, **kw):
        check_arrays(KERNEL_NAME, dict(zip(cls.ARGS[:4], args[:4])))
        from ._base import _default_kernel
        from ..core import backend_of

        return _default_kernel(cls, config, backend_of())(*args, **kw)


build = DecodeAttentionKernel.build


def decode_attention(q, k_pool, v_pool, kv_len, kv_end=None, table=None, *, scale, window: int = 0,
                     softcap: float = 0.0, check: bool = True):
    """Functional entry: the native kernel for the default device when its artifact is available,
    else the reference (module docstring)."""
    return DecodeAttentionKernel.functional((q, k_pool, v_pool, kv_len, kv_end, table), scale=scale, window=window,
                                            softcap=softcap, check=check)


def decode_attention_reference(q, k_pool, v_pool, kv_len, kv_end=None, table=None, *, scale, window: int = 0,
                               softcap: float = 0.0):
    """Pure-MLX decode_attention; runs on every MLX device."""
    kernel = DecodeAttentionKernel(backend="cpu")
    kv_end = kv_len if kv_end is None else kv_end
    kernel.validate(q, k_pool, v_pool, kv_len, kv_end, table, scale, window, softcap)
    return kernel.reference(q, k_pool, v_pool, kv_len, kv_end, table, scale, window, softcap)
