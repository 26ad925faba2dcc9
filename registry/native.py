"""Python side of the generic AOT launcher (csrc/, module registry._ext).

One lifecycle for every backend, run once when a kernel set is built (never per call):
find the artifact (registry.artifacts.lookup) -> verify it (source digest, size, sha256, entry
symbols, on bytes read once) -> hand those verified bytes to the extension, which loads them from
memory (never the file again, so a file swapped after the check is never run); otherwise return
None and the reason, and the kernel object falls back to its reference path.
MLX_AOT_DISABLE_NATIVE forces the fallback; MLX_AOT_REQUIRE_NATIVE turns the fallback into an error
that carries the fix.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import numbers
import struct
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from . import envs
from .artifacts import lookup
from .errors import ArtifactError, KernelArgumentError, NativeUnavailableError
from .manifest import KernelSpec

log = logging.getLogger("registry")

_ROLE = {"input": 0, "output": 1, "inplace": 2}
_BUILD_FIX = ("build it with `pip install -e '.[cpu]'` (Linux CPU), `pip install --no-build-isolation -e "
              "'.[cuda13]'` (Linux CUDA) or `pip install -e .` (macOS)")


def import_ext():
    """registry._ext, or NativeUnavailableError saying why and how to build it."""
    try:
        from . import _ext
    except ImportError as e:
        raise NativeUnavailableError(f"native extension registry._ext is not importable ({e}); {_BUILD_FIX}") from None
    return _ext


def _f32_bits(name: str, value: Any) -> int:
    """The float32 bit pattern the kernel receives. Values round to the nearest float32 (the kernel
    computes in fp32, as MLX's own fp32 paths do); what float32 cannot hold at all is an error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KernelArgumentError(f"scalar {name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise KernelArgumentError(f"scalar {name}={value} is not finite")
    try:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    except OverflowError:
        raise KernelArgumentError(f"scalar {name}={value} does not fit in float32") from None


def _i32_bits(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise KernelArgumentError(f"scalar {name} must be an int32, got {type(value).__name__} {value!r}")
    value = int(value)
    if not -2**31 <= value < 2**31:
        raise KernelArgumentError(f"scalar {name}={value} does not fit in int32")
    return value & 0xFFFFFFFF


_KERNEL_CALLER_ADVICE = ("Rebind the returned pools and keep no other array object of them (docs/native.md, "
                         "\"In-place outputs\").")

# Called (no arguments) when a launch copies a pool, to say what the caller should do instead: the
# first non-empty answer replaces _KERNEL_CALLER_ADVICE. An integration whose users never see the
# pools (the drop-in cache) registers one; nothing runs on launches that write in place.
COPY_ADVISERS: list = []


def _advice_of(adviser) -> str | None:
    try:
        return adviser()
    except Exception:          # advice only: a broken adviser must not fail the launch that copies
        log.debug("copy adviser %r failed", adviser, exc_info=True)
        return None


class Launcher:
    """A loaded artifact of one kernel for one backend: `launch(...)` builds one lazy MLX primitive."""

    def __init__(self, spec: KernelSpec, backend: str, path: str, entries: dict[str, str], ext: Any,
                 image: bytes | None = None):
        """`image`: the verified artifact bytes the extension loads (registry._ext requires them; a
        stand-in extension such as the Metal emulation's may take none). `path` names it in messages."""
        sig = spec.signature
        names = [b.name for b in sig.buffers]
        self.spec = spec
        self.backend = backend
        self.path = path
        self.entries = dict(entries)
        self._ext = ext
        self._input_names = [b.name for b in sig.inputs]
        self._scalar_names = [s.name for s in sig.scalars]
        self._scalar_is_float = [s.type == "float32" for s in sig.scalars]
        # Per buffer: a fixed dtype, or the group whose dtype the entry key gives (outputs: their like's).
        by_name = {b.name: b for b in sig.buffers}
        self._buffer_groups = [(b.dtype, by_name[b.like].dtype_group if b.like else b.dtype_group)
                               for b in sig.buffers]
        # The key names one exact binary: the launcher caches loaded modules and libraries under it.
        digest = hashlib.sha256(image).hexdigest()[:32] if image is not None else Path(path).name
        kw = {} if image is None else {"image": image}
        self._binary = ext.KernelBinary(
            key=f"mlx_aot_{spec.name}_{digest}", path=path, target=backend,
            roles=[_ROLE[b.role] for b in sig.buffers],
            like=[names.index(b.like) if b.like else -1 for b in sig.buffers],
            strided=[int(b.strided) for b in sig.buffers],
            scalar_types=[1 if f else 0 for f in self._scalar_is_float],
            specialize=[int(s.specialize) for s in sig.scalars], **kw)
        self._buffer_names = names
        self.copies = 0
        self._binary.on_copy = self._on_copy  # called by the extension, only when a pool is copied

    def _on_copy(self, buffer: int, reason: str) -> None:
        # Steady-state decode never copies a pool (docs/native.md): a copy is worth one warning.
        self.copies += 1
        if self.copies == 1:
            advice = next((a for a in map(_advice_of, COPY_ADVISERS) if a), _KERNEL_CALLER_ADVICE)
            log.warning("%s: %s was written through a copy-on-write copy (one full copy of the pool, for this call; "
                        "the values are right either way) because %s. %s This warning is given once per kernel "
                        "object; registry.native.stats() counts every copy.",
                        self.spec.name, self._buffer_names[buffer], reason, advice)

    @property
    def raw_launch(self) -> tuple[Any, Any]:
        """(launch function, binary) for wrappers' hot paths: launch(binary, plan, arrays, stream) with a
        plan from `plan()` and arrays in `input_names` order."""
        return self._ext.launch, self._binary

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self._input_names)

    def plan(self, dtype: str, scalars: dict[str, int | float], *, grid: Sequence[int],
             threadgroup: Sequence[int], input_shapes: Sequence[Sequence[int]] | None = None) -> Any:
        """Everything of a launch but the arrays, validated and packed once; reuse it for every call
        with the same shapes (the per-call cost is then one extension call). `dtype` is an entry key
        of the manifest: '<act>' (every buffer without a fixed dtype) or '<act>/<pool>' (buffers of
        `dtype_group: pool` take the second). `input_shapes` (one per input, in `input_names` order):
        the shapes the scalars and geometry were computed for; a launch of the plan on other shapes is
        then an error instead of out-of-bounds indexing."""
        entry = self.entries.get(dtype)
        if entry is None:
            raise KernelArgumentError(f"{self.spec.name}: no entry for dtype {dtype}; the manifest declares "
                                      f"{', '.join(self.entries)}")
        act, _, pool = dtype.partition("/")
        buffer_dtypes = [fixed or (pool or act if group == "pool" else act) for fixed, group in self._buffer_groups]
        try:
            bits = [_f32_bits(n, scalars[n]) if f else _i32_bits(n, scalars[n])
                    for n, f in zip(self._scalar_names, self._scalar_is_float)]
        except KeyError as e:
            raise KernelArgumentError(f"{self.spec.name}: missing scalar {e.args[0]!r}; the signature needs "
                                      f"{self._scalar_names}") from None
        kw = {} if input_shapes is None else {"input_shapes": [[int(d) for d in s] for s in input_shapes]}
        return self._ext.LaunchArgs(entry, bits, tuple(grid), tuple(threadgroup), dtype, buffer_dtypes, **kw)

    def run(self, plan: Any, arrays: list[mx.array], stream: Any = None) -> list[mx.array]:
        """Launch with a plan; `arrays` are the signature's inputs in `input_names` order."""
        return self._ext.launch(self._binary, plan, arrays, stream)

    def launch(self, dtype: str, inputs: dict[str, mx.array], scalars: dict[str, int | float], *,
               grid: Sequence[int], threadgroup: Sequence[int], stream: Any = None) -> list[mx.array]:
        """One-off launch by names (plan + run)."""
        try:
            arrays = [inputs[n] for n in self._input_names]
        except KeyError as e:
            raise KernelArgumentError(f"{self.spec.name}: missing argument {e.args[0]!r}; the signature needs "
                                      f"buffers {self._input_names}") from None
        return self.run(self.plan(dtype, scalars, grid=grid, threadgroup=threadgroup), arrays, stream)


def stats() -> dict[str, int]:
    """Process-wide counters of the native launcher (all kernels, all backends):

    - `launches`: native kernel launches built;
    - `aliased`: in-place buffers (pools) written where they lie;
    - `copies`: in-place buffers written through a copy-on-write copy (MLX may still donate the
      buffer instead of copying it when nothing can read it any more);
    - `first_use_checks`: buffers checked for sharing the first time the launcher took them;
    - `syncs`: host waits: a first-use check after in-flight work, or computing a lazy pool;
    - `output_mallocs`, `output_frees` (CUDA; 0 elsewhere, where MLX's allocator serves the outputs):
      fresh outputs allocated with cudaMallocAsync because the launcher's free list had no buffer of
      that size for the stream, and device buffers freed: evicted from a full list (it keeps
      256 MiB, evicting the buffers given back longest ago), larger than it, or all of it given
      back when an allocation ran out of memory;
    - `owned_pools`: live pool buffers the launcher has written in place.
    """
    return dict(import_ext().stats())


def reset_stats() -> None:
    import_ext().reset_stats()


_PAD: list = []        # four int32 zeros the GPU wrote: the shared tail of every device_indices buffer


def device_indices(backend: str, *arrays) -> tuple[mx.array, ...]:
    """int32 index arrays (positions, slots, tables: numpy arrays or int sequences) as mx.arrays of
    their shapes, for the kernels of `backend` and the MLX ops beside them. On CUDA, MLX keeps an
    array made from host data, and any array of at most 8 bytes, in managed memory, which a kernel
    reads across the bus: 6 of a decode launch's 10 us of rope_pool_fused on the H200
    (docs/benchmarks/e2e-root-cause.md, "Host memory on CUDA"). So there they become views of one device buffer
    of more than 8 bytes that one concatenate (a kernel: once per step where the caller memoises)
    copies them into; each 1-D view is an mx.contiguous, which the launcher takes as it is. On other
    backends: plain mx.arrays."""
    parts = [np.asarray(a, dtype=np.int32) for a in arrays]
    if backend != "cuda":
        return tuple(mx.array(p) for p in parts)
    if not _PAD:
        _PAD.append(mx.zeros((4,), dtype=mx.int32))
    flat = mx.concatenate([mx.array(np.concatenate([p.reshape(-1) for p in parts])), _PAD[0]])
    out, at = [], 0
    for p in parts:
        view = flat[at:at + p.size]
        at += p.size
        out.append(mx.contiguous(view) if p.ndim == 1 else view.reshape(p.shape))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def device_arange(start: int, n: int, step: int, backend: str) -> mx.array:
    """int32 [n]: start, start + step, ..., made on the device by one Arange, for per-step indices
    that are a progression (a decode token's position and slot; a batch's slots b * S + row): no host
    data, so on CUDA nothing in managed memory (see device_indices) and no copy of it per step. The
    range runs two steps past n so that MLX allocates more than 8 bytes, which it keeps in device
    memory; the [:n] view of it is an mx.contiguous, as device_indices' are. Memoised: every layer of
    a step asks for the same (an evaluated hit is a constant; cache_clear() drops them)."""
    step = step if n > 1 else 1
    stop = start + (n + 2) * step
    if (n > 1 and step == 0) or not -2**31 <= min(start, stop) <= max(start, stop) < 2**31:   # the padded range: int32
        return device_indices(backend, start + step * np.arange(n, dtype=np.int64))[0]
    return mx.contiguous(mx.arange(start, stop, step, dtype=mx.int32)[:n])


def _device_arch(ext) -> str:
    arch = ext.cuda_device_arch(0)
    if not arch:
        raise NativeUnavailableError("registry._ext was built without CUDA support, but MLX runs on CUDA; "
                                     "rebuild against mlx[cuda13]: pip install --no-build-isolation -e '.[cuda13]'")
    return arch


def _load(spec: KernelSpec, backend: str) -> Launcher:
    if envs.get_flag("MLX_AOT_DISABLE_NATIVE"):
        raise NativeUnavailableError("MLX_AOT_DISABLE_NATIVE is set")
    ext = import_ext()
    if backend == "cuda" and not ext.built_with_cuda():
        raise NativeUnavailableError("registry._ext was built without CUDA (against mlx[cpu]); rebuild with "
                                     "`pip install --no-build-isolation -e '.[cuda13]'` on the CUDA machine")
    if backend == "metal" and not ext.built_with_metal():
        raise NativeUnavailableError("registry._ext was built without Metal; rebuild it on macOS: pip install -e .")
    arch = _device_arch(ext) if backend == "cuda" else None
    found = lookup(spec, backend, arch=arch)
    if found.path is None:
        raise ArtifactError(found.reason)
    launcher = Launcher(spec, backend, str(found.path), found.entries, ext, image=found.data)
    launcher.reason = found.reason
    return launcher


def load_launcher(spec: KernelSpec, backend: str) -> tuple[Launcher | None, str]:
    """(launcher, why) or (None, why not). With MLX_AOT_REQUIRE_NATIVE set, 'why not' is raised."""
    try:
        launcher = _load(spec, backend)
        return launcher, launcher.reason
    except (NativeUnavailableError, ArtifactError) as e:
        if envs.get_flag("MLX_AOT_REQUIRE_NATIVE") and not envs.get_flag("MLX_AOT_DISABLE_NATIVE"):
            raise type(e)(f"{spec.name} on {backend}: {e} (MLX_AOT_REQUIRE_NATIVE is set)") from None
        return None, str(e)
