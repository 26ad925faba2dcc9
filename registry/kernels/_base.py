"""What every kernel wrapper shares, so a wrapper holds only its own argument contract, reference
math, launch geometry and scalars (docs/manifest.md, "Adding a kernel").

`PoolKernel` owns:
  - the native-or-reference choice and its reason (`build(spec, ctx)`: registry.native's one
    lifecycle, find -> verify -> load, else the reference path and why);
  - the plan cache: full validation and the packed launch (scalars, geometry, entry) once per shape
    and dtype signature, then one dict lookup and one extension call per call; `bind(*args)` hands
    out that signature's launch as a callable (the extension call alone) for integrations that
    know their shapes have not changed, `last_bound()` one that rebinds when the launcher refuses
    a new signature;
  - the slot check (`check_slots=True`): slots in range, no duplicate valid slot, positions in
    [0, 2^24] when the kernel takes positions, all in one host sync;
  - the functional entry (`functional`), which builds the kernel for the default device through a
    synthetic SelectionContext.
It also has the pool helpers the reference paths share: the two pool layouts of docs/kernel-abi.md
(slot-major [S, Hkv, D] and head-major [B, Hkv, S, D]) and a lazy, bounds-safe row store.

A subclass sets NAME, ARGS (call arguments), INPUTS (the signature's inputs in launch order) and
defines validate, reference, launch_config and launch_arrays; config_from / context_fields when it
is configured by more than the backend (RoPE, norms).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..core import DTYPE_NAMES, SelectionContext, backend_of
from ..errors import KernelArgumentError

log = logging.getLogger("registry")

MAX_POSITION = 2 ** 24          # fp32 angles beyond are meaningless (docs/kernel-abi.md)
INT32_MAX = 2 ** 31 - 1
_REFERENCE = object()           # the plan of a kernel object without a native launcher
_MAX_PLANS = 256


def shape_str(a: Any) -> str:
    return "x".join(str(s) for s in a.shape) if hasattr(a, "shape") else type(a).__name__


# ----------------------------------------------------------------------------- pools

SLOT_MAJOR, HEAD_MAJOR = 0, 1   # the kernels' pool_layout scalar
_LAYOUTS = {3: ("slot-major", "[pool_size, n_kv_heads={H}, {W}]"),
            4: ("head-major", "[batch, n_kv_heads={H}, rows, {W}]")}
QUANT_BITS = (4, 8)             # mlx-lm's QuantizedKVCache formats the quantized kernels implement
QUANT_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class PoolFormat:
    """How one side (K or V) of a KV cache stores its rows: a pool group, a named group of arrays of
    one layout, each with its own dtype and row width (docs/kernel-abi.md, "Pool groups"):
      - float rows (bits None): `<side>_pool`, head_dim wide, float16/bfloat16/float32;
      - mlx-lm's affine quantization (`mx.quantize(x, group_size, bits)`): `<side>_pool` packed uint32
        words head_dim * bits / 32 wide, `<side>_scales` and `<side>_biases` head_dim / group_size
        wide, in the scales' float dtype."""

    bits: int | None = None
    group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def members(self) -> tuple[str, ...]:
        return ("pool", "scales", "biases") if self.quantized else ("pool",)

    def names(self, side: str) -> tuple[str, ...]:
        """The group's argument names for side 'k' or 'v'."""
        return tuple(f"{side}_{m}" for m in self.members)

    def widths(self, dim: int) -> tuple[int, ...]:
        """Each member's row width for head_dim `dim`."""
        if not self.quantized:
            return (dim,)
        return (dim * self.bits // 32, dim // self.group_size, dim // self.group_size)

    def width_names(self) -> tuple[str, ...]:
        return ("head_dim={D}",) if not self.quantized else (
            f"head_dim*{self.bits}/32={{W}}", f"head_dim/{self.group_size}={{G}}", f"head_dim/{self.group_size}={{G}}")

    def check(self, kernel: str, head_dim: int) -> None:
        """bits and group_size of a format the quantized kernels implement, dividing head_dim."""
        if not self.quantized:
            return
        if self.bits not in QUANT_BITS:
            raise KernelArgumentError(f"{kernel}: bits={self.bits!r}: the kernel stores 4- or 8-bit rows")
        if self.group_size not in QUANT_GROUP_SIZES:
            raise KernelArgumentError(f"{kernel}: group_size={self.group_size!r} is not one of "
                                      f"{', '.join(map(str, QUANT_GROUP_SIZES))}")
        if head_dim % self.group_size:
            raise KernelArgumentError(f"{kernel}: group_size={self.group_size} does not divide head_dim={head_dim}")

    def __str__(self) -> str:
        return "float rows" if not self.quantized else f"{self.bits}-bit, group size {self.group_size}"


FLOAT_POOLS = PoolFormat()


class FormatConfig:
    """Mixed in before a kernel class whose objects are configured by a quantized cache's PoolFormat
    (the selection context's kv_bits and kv_group_size): `self.fmt`."""

    def __init__(self, fmt: PoolFormat, **kw):
        super().__init__(fmt, **kw)
        self.fmt = fmt

    @classmethod
    def config_from(cls, ctx: SelectionContext) -> PoolFormat:
        return PoolFormat(ctx.kv_bits, ctx.kv_group_size)

    @classmethod
    def context_fields(cls, fmt: PoolFormat) -> dict:
        return dict(kv_bits=fmt.bits, kv_group_size=fmt.group_size)


class PoolGeometry:
    """A pool's layout read off its rank: slot-major [S, Hkv, W] (slot s is row s) or head-major
    [B, Hkv, S, W] (mlx-lm's KVCache; slot = b * S + s). `size` = total slots, `rows` = S, `dim` = W
    (any member of a pool group: they share everything but W)."""

    __slots__ = ("layout", "size", "rows", "heads", "dim")

    def __init__(self, pool: mx.array):
        if pool.ndim == 3:
            self.layout, (self.size, self.heads, self.dim) = SLOT_MAJOR, pool.shape
            self.rows = self.size
        else:
            B, self.heads, self.rows, self.dim = pool.shape
            self.layout, self.size = HEAD_MAJOR, B * self.rows

    @property
    def scalars(self) -> dict[str, int]:
        return dict(pool_size=self.size, pool_rows=self.rows, pool_layout=self.layout)


def check_arrays(kernel: str, named: dict[str, Any]) -> None:
    for name, a in named.items():
        if not isinstance(a, mx.array):
            raise KernelArgumentError(f"{kernel}: {name} must be an mx.array, got {type(a).__name__}")


TOKEN_MAJOR, HEAD_MAJOR_ACT = 0, 1   # the kernels' act_layout scalar (docs/kernel-abi.md)


def rows_of(x: mx.array) -> tuple[int, int, int]:
    """(tokens, heads, head_dim) of an activation: [T, H, D], or [B, H, L, D] with T = B * L."""
    if x.ndim == 3:
        return x.shape[0], x.shape[1], x.shape[2]
    return x.shape[0] * x.shape[2], x.shape[1], x.shape[3]


def act_scalars(x: mx.array) -> dict[str, int]:
    """The kernels' act_layout and seq_len for activations shaped like x."""
    return dict(act_layout=TOKEN_MAJOR, seq_len=1) if x.ndim == 3 else dict(act_layout=HEAD_MAJOR_ACT,
                                                                            seq_len=x.shape[2])


def to_rows(x: mx.array) -> mx.array:
    """[B, H, L, D] -> token-major [B * L, H, D] (token t = b * L + l); [T, H, D] as it is. For the
    reference paths: the kernels read either layout in place."""
    if x.ndim == 3:
        return x
    B, H, L, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * L, H, D)


def from_rows(y: mx.array, like: mx.array) -> mx.array:
    """The inverse of to_rows for an array shaped like `like` (its heads may differ: q vs k)."""
    if like.ndim == 3:
        return y
    B, _, L, D = like.shape
    return y.reshape(B, L, y.shape[1], D).transpose(0, 2, 1, 3)


def check_activations(kernel: str, named: dict[str, mx.array]) -> None:
    """Float arrays of one dtype (the first one's), all token-major [tokens, heads, head_dim] or all
    head-major [batch, heads, seq_len, head_dim] (the attention's layout) of one batch and seq_len;
    any strides (the kernels read them in place)."""
    first, *rest = named
    rank = named[first].ndim
    for name, a in named.items():
        if a.ndim not in (3, 4) or a.ndim != rank:
            like = "" if name == first else f" like {first} ({shape_str(named[first])})"
            raise KernelArgumentError(f"{kernel}: {name} must be 3-D [tokens, heads, head_dim] or 4-D [batch, heads, "
                                      f"seq_len, head_dim]{like}, got shape {shape_str(a)}")
        if rank == 4 and (a.shape[0], a.shape[2]) != (named[first].shape[0], named[first].shape[2]):
            raise KernelArgumentError(f"{kernel}: {name} {shape_str(a)} must have the batch and seq_len of {first} "
                                      f"{shape_str(named[first])}")
    if named[first].dtype not in DTYPE_NAMES:
        raise KernelArgumentError(f"{kernel}: {first} dtype {named[first].dtype} is not float16, bfloat16 or float32")
    for name in rest:
        if named[name].dtype != named[first].dtype:
            raise KernelArgumentError(f"{kernel}: {name} dtype {named[name].dtype} differs from {first} dtype "
                                      f"{named[first].dtype}; {', '.join(named)} must match")


def check_pool_ranks(kernel: str, pools: dict[str, mx.array], fmt: PoolFormat = FLOAT_POOLS) -> None:
    width = "head_dim" if not fmt.quantized else "width"
    for name, p in pools.items():
        if p.ndim not in _LAYOUTS:
            raise KernelArgumentError(
                f"{kernel}: {name} must be a slot-major [pool_size, n_kv_heads, {width}] (3-D) or head-major "
                f"[batch, n_kv_heads, rows, {width}] (4-D) pool, got shape {shape_str(p)}")


def check_pools(kernel: str, pools: dict[str, mx.array], heads: int, dim: int,
                fmt: PoolFormat = FLOAT_POOLS, act_dtype: mx.Dtype | None = None) -> PoolGeometry:
    """The K and V pool groups (`pools`: fmt.names('k') + fmt.names('v'), in that order): every array of
    one layout and one slot count, `heads` x its member's width (PoolFormat.widths), at most INT32_MAX
    slots. Float rows: both pools of one float dtype (any of the three, whatever the activations':
    the kernels convert on the store). Quantized: uint32 words, scales and biases of one float dtype,
    the activations' (`act_dtype`, when given: mlx-lm keeps them in the keys' dtype)."""
    want = fmt.names("k") + fmt.names("v")
    if tuple(pools) != want:   # a wrapper's contract, not the caller's
        raise KernelArgumentError(f"{kernel}: pools {', '.join(pools)}; the {fmt} format has {', '.join(want)}")
    check_arrays(kernel, pools)
    check_pool_ranks(kernel, pools, fmt)
    first = want[0]
    if not fmt.quantized:
        k_pool, v_pool = pools["k_pool"], pools["v_pool"]
        if k_pool.dtype not in DTYPE_NAMES:
            raise KernelArgumentError(f"{kernel}: k_pool dtype {k_pool.dtype} is not float16, bfloat16 or float32 (a "
                                      f"pool may differ from the activations' dtype, but must be one of these)")
        if v_pool.dtype != k_pool.dtype:
            raise KernelArgumentError(f"{kernel}: v_pool dtype {v_pool.dtype} differs from k_pool dtype "
                                      f"{k_pool.dtype}; the pools must match")
    else:
        fmt.check(kernel, dim)
        scales = pools["k_scales"]
        for name, p in pools.items():
            if name.endswith("_pool") and p.dtype != mx.uint32:
                raise KernelArgumentError(f"{kernel}: {name} dtype {p.dtype} is not uint32 (the packed words of "
                                          f"a quantized pool)")
        if scales.dtype not in DTYPE_NAMES:
            raise KernelArgumentError(f"{kernel}: k_scales dtype {scales.dtype} is not float16, bfloat16 or float32")
        for name, p in pools.items():
            if not name.endswith("_pool") and p.dtype != scales.dtype:
                raise KernelArgumentError(f"{kernel}: {name} dtype {p.dtype} differs from k_scales dtype "
                                          f"{scales.dtype}; scales and biases must match")
        if act_dtype is not None and scales.dtype != act_dtype:
            raise KernelArgumentError(f"{kernel}: k_scales dtype {scales.dtype} differs from the activations' "
                                      f"{act_dtype}: the kernel keeps scales and biases in the activations' dtype, "
                                      f"as mlx-lm's QuantizedKVCache keeps them in the keys'")
    widths = fmt.widths(dim)
    values = dict(H=heads, D=dim, W=widths[0], G=widths[-1])
    for side in ("k", "v"):
        for name, width, what in zip(fmt.names(side), widths, fmt.width_names()):
            p = pools[name]
            if p.shape[1] != heads or p.shape[-1] != width:
                layout, form = _LAYOUTS[p.ndim]
                raise KernelArgumentError(f"{kernel}: {name} {shape_str(p)}: a {layout} pool must be "
                                          + form.format(H=heads, W=what.format(**values)))
    for name, p in pools.items():
        if p.shape[:-1] != pools[first].shape[:-1] or p.ndim != pools[first].ndim:
            raise KernelArgumentError(f"{kernel}: {first} {shape_str(pools[first])} and {name} {shape_str(p)} must "
                                      f"have the same shape" + ("" if not fmt.quantized else
                                                                " but for the last axis (one slot per row)"))
    geo = PoolGeometry(pools[first])
    if geo.size > INT32_MAX:
        raise KernelArgumentError(f"{kernel}: {first} {shape_str(pools[first])} holds {geo.size} slots, more than "
                                  f"INT32_MAX = {INT32_MAX}: slots and the kernel's pool_size are int32")
    return geo


def check_index(kernel: str, name: str, a: mx.array, tokens: int) -> None:
    if a.dtype != mx.int32 or tuple(a.shape) != (tokens,):
        raise KernelArgumentError(f"{kernel}: {name} must be int32 [tokens={tokens}], got {a.dtype} {shape_str(a)}")


def pool_dtype_key(act: mx.Dtype, pool: mx.Dtype) -> str:
    """The `entries` key (docs/manifest.md): '<act>' when the pool has the activations' dtype, else
    '<act>/<pool>'."""
    return DTYPE_NAMES[act] if act == pool else f"{DTYPE_NAMES[act]}/{DTYPE_NAMES[pool]}"


def store_rows(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """`pool` with slot slots[t] = rows[t] [Hkv, W] (converted to the pool's dtype) where slots[t] is in
    range, lazily (no host sync), either layout: one scatter of head rows into the pool seen as
    [rows, W], with 64-bit row indices (any member of a pool group: W is its own width). Tokens that must not be written repeat a valid token's write
    (the same value, so the repeated index cannot conflict); with no valid token, row indices of
    slot 0 get their own values."""
    geo = PoolGeometry(pool)
    if slots.size == 0 or geo.size == 0 or geo.heads == 0:
        return mx.array(pool)
    valid = (slots >= 0) & (slots < geo.size)
    j = mx.argmax(valid)
    any_valid = valid[j]
    idx = mx.where(valid, slots, mx.where(any_valid, slots[j], 0)).astype(mx.int64)
    h = mx.arange(geo.heads, dtype=mx.int64)[None]
    if geo.layout == SLOT_MAJOR:
        flat_rows = idx[:, None] * geo.heads + h
    else:
        flat_rows = ((idx // geo.rows)[:, None] * geo.heads + h) * geo.rows + (idx % geo.rows)[:, None]
    out = pool.reshape(-1, geo.dim)  # a new array object: the caller's pool object is left as it was
    fallback = mx.where(any_valid, rows[j].astype(pool.dtype)[None], out[flat_rows])
    vals = mx.where(valid[:, None, None], rows.astype(pool.dtype), fallback)
    out[flat_rows.reshape(-1)] = vals.reshape(-1, geo.dim)
    return out.reshape(pool.shape)


def group_rows(x: mx.array, fmt: PoolFormat) -> tuple[mx.array, ...]:
    """Rows x [..., head_dim] in a pool group's format: (x,) for float rows, else mlx-lm's own
    `mx.quantize(x, group_size, bits)` (words, scales, biases), the oracle of the quantized kernels."""
    if not fmt.quantized:
        return (x,)
    return tuple(mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits))


def store_group(pools: tuple[mx.array, ...], slots: mx.array, rows: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    """store_rows for every member of a pool group (the same slots, each member's own rows)."""
    return tuple(store_rows(p, slots, r) for p, r in zip(pools, rows))


def check_slot_values(kernel: str, slots: mx.array, pool_size: int, positions: mx.array | None = None) -> None:
    """check_slots=True: slots < pool_size, no valid slot twice, and (given positions) positions in
    [0, 2^24], in one host sync. Engines call it once per step and pass check_slots=False to every
    layer; the kernels never write out of range regardless."""
    if slots.size == 0:
        return
    valid = (slots >= 0) & (slots < pool_size)
    # Invalid slots become distinct negatives, so only valid repeats sort next to each other.
    keys = mx.sort(mx.where(valid, slots, -1 - mx.arange(slots.size, dtype=mx.int32)))
    checks = [mx.max(slots) >= pool_size, mx.any(keys[1:] == keys[:-1])]
    if positions is not None:
        checks += [mx.min(positions) < 0, mx.max(positions) > MAX_POSITION]
    out_of_range, repeated, *bad_positions = mx.stack(checks).tolist()   # the one host sync
    if out_of_range:
        t = int(mx.argmax(slots >= pool_size).item())
        raise KernelArgumentError(f"{kernel}: slots[{t}]={int(slots[t].item())} is out of range for a pool of "
                                  f"{pool_size} slots (valid: 0..{pool_size - 1}, or < 0 to skip the write)")
    if repeated:
        first: dict[int, int] = {}
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0 and slot in first:
                raise KernelArgumentError(f"{kernel}: slots[{t}]={slot} repeats slots[{first[slot]}]: a slot may be "
                                          f"written once per call (unchecked, which token's row lands is unspecified)")
            first.setdefault(slot, t)
    if any(bad_positions):
        p = positions.tolist()
        t = next(i for i, x in enumerate(p) if not 0 <= x <= MAX_POSITION)
        raise KernelArgumentError(f"{kernel}: positions[{t}]={p[t]} is outside [0, 2^24 = {MAX_POSITION}]: fp32 "
                                  f"RoPE angles are meaningless beyond (unchecked, every path computes "
                                  f"float(position) * pos_scale * inv_freq all the same)")


# ----------------------------------------------------------------------------- derived inputs

class DerivedArray:
    """`make(*arrays)`, made once per distinct tuple of argument arrays and reused while the same
    arrays are passed again: a kernel's per-layer input derived from its arguments (e.g. one table of
    the layer's norm weights, since every buffer is a graph edge that MLX pays for at every call).

    Identity is the arrays' MLX descriptors (registry._ext.array_ids), never their values: an MLX array's
    value never changes, and an update in place (`w[...] = x`, `w += 1`) gives the Python object a new
    descriptor, so it is made again. Each entry holds its arrays (a handle on their descriptors), so
    no id is reused while the entry lives. At most `limit` entries; a full cache starts again."""

    __slots__ = ("make", "limit", "_entries", "_ids")

    def __init__(self, make, limit: int = 256):
        from ..native import import_ext   # only the native path derives inputs

        self.make, self.limit = make, limit
        self._entries: dict[tuple, tuple] = {}
        self._ids = import_ext().array_ids

    def __call__(self, *arrays: mx.array) -> mx.array:
        key = self._ids(*arrays)
        hit = self._entries.get(key)
        if hit is None:
            if len(self._entries) >= self.limit:
                self._entries.clear()
            held = [mx.array(a) for a in arrays]    # mx.array(a) shares a's descriptor: it holds the id
            hit = self._entries[key] = (held, self.make(*arrays))
        return hit[1]


# ----------------------------------------------------------------------------- the kernel object

class PoolKernel:
    """A kernel object as `KernelSet.<kernel_attr>` holds it: call it with ARGS.

    `implementation` says what runs: 'native-cuda', 'native-metal', 'native-cpu' or 'reference';
    `reason` says why (which artifact was loaded, or why the native path is unavailable).
    """

    NAME: str = ""
    ARGS: tuple[str, ...] = ()        # call arguments, in order
    INPUTS: tuple[str, ...] = ()      # kernels.yaml signature inputs (role input/inplace) in launch order
    SLOTS, POSITIONS, POOL = "slots", None, "k_pool"   # argument names the slot check reads

    def __init__(self, config: Any = None, *, backend: str, device: mx.Device | None = None,
                 launcher: Any = None, reason: str = ""):
        self.config = config
        self.backend = backend
        self.device = device
        self._launcher = launcher
        self.reason = reason
        self._plans: dict[tuple, Any] = {}
        self.enabled = True
        self._slot_arg = self.ARGS.index(self.SLOTS) if self.SLOTS else None   # None: no slot check
        self._pos_arg = self.ARGS.index(self.POSITIONS) if self.POSITIONS else None
        self._pool_arg = self.ARGS.index(self.POOL)
        if launcher is not None:
            if launcher.input_names != self.INPUTS:
                raise KernelArgumentError(f"{self.NAME}: kernels.yaml signature inputs {launcher.input_names} "
                                          f"differ from the wrapper's {self.INPUTS}")
            self._launch, self._binary = launcher.raw_launch

    # -- what a wrapper defines
    def validate(self, *args) -> None:
        """Raise KernelArgumentError naming the argument, the expectation and the shapes seen."""
        raise NotImplementedError

    def reference(self, *args) -> tuple:
        """The pure-MLX path (fallback and oracle); the same results as the native kernels."""
        raise NotImplementedError

    def launch_config(self, *args) -> tuple[str, dict, tuple, tuple]:
        """(entries key, scalars, grid, threadgroup) for self.backend; called once per shape signature."""
        raise NotImplementedError

    def launch_arrays(self, *args) -> list:
        """The arrays of INPUTS, in order."""
        raise NotImplementedError

    @classmethod
    def config_from(cls, ctx: SelectionContext) -> Any:
        """The kernel object's configuration from a selection context (None: the backend is enough)."""
        return None

    @classmethod
    def context_fields(cls, config: Any) -> dict[str, Any]:
        """The SelectionContext fields that carry `config` (the inverse of config_from)."""
        return {}

    @classmethod
    def context_for(cls, config: Any, backend: str) -> SelectionContext:
        """A synthetic selection context for the functional entry (and tests, benchmarks)."""
        fields = dict(attention="mha", rope=None, rope_error="", n_heads=0, n_kv_heads=0, head_dim=0, dtype=None,
                      backend=backend, device=None)
        return SelectionContext(**{**fields, **cls.context_fields(config)})

    # -- shared
    @property
    def implementation(self) -> str:
        return f"native-{self.backend}" if self._launcher is not None else "reference"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(config={self.config!r}, implementation={self.implementation})"

    def _new_plan(self, args) -> Any:
        self.validate(*args)   # full validation once per shape signature
        if self._launcher is None:
            return _REFERENCE
        key, scalars, grid, group = self.launch_config(*args)
        shapes = [a.shape for a in self.launch_arrays(*args)]
        return self._launcher.plan(key, scalars, grid=grid, threadgroup=group, input_shapes=shapes)

    def _plan(self, args: tuple) -> Any:
        """The plan of args' shape/dtype signature: validated and made on first sight, then one dict
        lookup."""
        if len(args) != len(self.ARGS):
            raise KernelArgumentError(f"{self.NAME}: expected {len(self.ARGS)} arguments ({', '.join(self.ARGS)}), "
                                      f"got {len(args)}")
        try:
            key = tuple([(a.shape, a.dtype) for a in args])   # a list comprehension: cheaper than a genexpr
        except AttributeError:
            key = None
        plan = self._plans.get(key)
        if plan is None:
            plan = self._new_plan(args)
            if len(self._plans) > _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def __call__(self, *args, check_slots: bool = True):
        plan = self._plan(args)
        if check_slots:
            pool = PoolGeometry(args[self._pool_arg])
            check_slot_values(self.NAME, args[self._slot_arg], pool.size,
                              None if self._pos_arg is None else args[self._pos_arg])
        if plan is _REFERENCE:
            return self.reference(*args)
        return tuple(self._launch(self._binary, plan, self.launch_arrays(*args), self.device))

    def bind(self, *args) -> Any:
        """The launch of args' shape/dtype signature as a callable `(*ARGS) -> outputs` (a sequence),
        validated here once, for an integration that knows its calls keep these shapes and dtypes:
        each call is then the extension call alone (no signature key, no lookup). It runs as
        check_slots=False. Pass arrays of exactly the bound shapes and dtypes: the native launcher
        refuses others (the plan carries its input shapes and buffer dtypes), the reference path
        does not check them."""
        plan = self._plan(args)
        if plan is _REFERENCE:
            return self.reference
        launch, binary, arrays, device = self._launch, self._binary, self.launch_arrays, self.device

        def bound(*a):
            return launch(binary, plan, arrays(*a), device)
        return bound

    def last_bound(self) -> Any:
        """A callable `(*ARGS) -> outputs` (as check_slots=False) for one caller's stream of calls:
        it launches through the bound plan of the last signature it saw and binds anew when the native
        launcher refuses the arrays (other shapes or dtypes: the refusal comes before anything is
        built), so steady calls skip even the signature key. A reference kernel has no launcher to
        refuse: its callable is the plain call, validated per signature as always."""
        if self._launcher is None:
            return functools.partial(self.__call__, check_slots=False)
        return _LastBound(self)

    @classmethod
    def build(cls, spec, ctx: SelectionContext) -> "PoolKernel":
        """Registry hook (kernels.yaml `wrapper`): native when the artifact for ctx.backend is present
        and fresh, else the reference path, with the reason either way."""
        from ..native import load_launcher  # the native side is optional: import only when building

        launcher, reason = load_launcher(spec, ctx.backend)
        if launcher is None:
            log.debug("%s: native path unavailable on %s: %s", cls.NAME, ctx.backend, reason)
        return cls(cls.config_from(ctx), backend=ctx.backend, device=ctx.device, launcher=launcher, reason=reason)

    @classmethod
    def functional(cls, args: tuple, config: Any = None, *, check_slots: bool = True):
        """The functional entry point: the kernel for the default device (native when its artifact is
        available, else the reference), argument errors before any manifest work."""
        check_arrays(cls.NAME, dict(zip(cls.ARGS, args)))
        cls(config, backend="cpu").validate(*args)
        return _default_kernel(cls, config, backend_of())(*args, check_slots=check_slots)


class _LastBound:
    """PoolKernel.last_bound's callable for a native kernel: the launch of the last signature's plan,
    called directly (one Python frame per call)."""

    __slots__ = ("kernel", "plan")

    def __init__(self, kernel: PoolKernel):
        self.kernel, self.plan = kernel, None

    def __call__(self, *args):
        k = self.kernel
        if self.plan is not None:
            try:
                return k._launch(k._binary, self.plan, k.launch_arrays(*args), k.device)
            except ValueError:             # the plan's shapes or dtypes differ: a new signature
                pass
        self.plan = k._plan(args)          # validated once per signature, as bind()
        return k._launch(k._binary, self.plan, k.launch_arrays(*args), k.device)


@functools.lru_cache(maxsize=64)
def _default_kernel(cls: type[PoolKernel], config: Any, backend: str) -> PoolKernel:
    from ..manifest import load_manifest

    return cls.build(load_manifest().kernel(cls.NAME), cls.context_for(config, backend))
