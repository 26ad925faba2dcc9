"""Parity cases: for every kernel of kernels.yaml, small inputs on which its native kernel must give
what its pure-MLX reference path (`reference`, MLX's own ops) gives. `python -m build_tools
selftest` runs them on the machine at hand (docs/build.md); tests/test_selftest.py runs them in CI
and fails for a kernel of kernels.yaml without one.

Adding a kernel: one function here, decorated with `@parity("<name>")`, returning its cases.

The input helpers (make_case, rope_variant, TOL, ...) are the test suite's too (tests/rope_cases.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .rope import RopeConfig

MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# fp32 angles at positions < 5000 carry up to pos * 2^-23 ~ 6e-4 rad of rounding against the float64
# oracle, times |x| <= ~4; f16/bf16 add one rounding of the result to the storage dtype.
TOL = {"float32": 3e-3, "float16": 6e-3, "bfloat16": 3e-2}


def rope_variant(name: str, head_dim: int) -> RopeConfig:
    partial = head_dim // 2 if head_dim % 4 == 0 else head_dim - 2
    if name == "full-base":
        return RopeConfig(head_dim, base=10000.0)
    if name == "full-traditional-freqs":
        return RopeConfig(head_dim, traditional=True, base=None,
                          periods=tuple(float(1.5 ** i) for i in range(head_dim // 2)))
    if name == "partial-base-scaled":
        return RopeConfig(partial, base=1e6, pos_scale=0.25, mscale=1.2)
    if name == "partial-traditional":
        return RopeConfig(partial, traditional=True, base=500.0)
    if name == "partial-freqs-inf":
        half = partial // 2
        return RopeConfig(partial, base=None, periods=tuple([10.0 ** (i / 4) for i in range(half - 2)]
                                                            + [float("inf")] * 2))
    if name == "odd-pairs":  # rotary_dims/2 odd: exercises the narrow-vector paths
        return RopeConfig(head_dim - 2 if (head_dim - 2) % 4 else head_dim - 6, traditional=head_dim % 128 == 0)
    raise KeyError(name)


VARIANTS = ["full-base", "full-traditional-freqs", "partial-base-scaled", "partial-traditional",
            "partial-freqs-inf", "odd-pairs"]


def make_case(T, Hq, Hkv, D, S, dtype, slots, seed=0, max_pos=5000, batch=None, pool_dtype=None):
    """q, k, v, positions, slots, k_pool, v_pool; pools slot-major [S, Hkv, D], or head-major
    [batch, Hkv, S, D] (batch * S slots) when `batch` is given; of `pool_dtype` (default: dtype)."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape, dt=dtype: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[dt])
    q, k, v = arr(T, Hq, D), arr(T, Hkv, D), arr(T, Hkv, D)
    pool_shape = (S, Hkv, D) if batch is None else (batch, Hkv, S, D)
    kp, vp = arr(*pool_shape, dt=pool_dtype or dtype), arr(*pool_shape, dt=pool_dtype or dtype)
    pos = mx.array(rng.integers(0, max_pos, size=T).astype(np.int32))
    return q, k, v, pos, mx.array(np.asarray(slots, dtype=np.int32)), kp, vp


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a if a.dtype == mx.int32 else a.astype(mx.float32))


def strided(x: mx.array, batch: int) -> mx.array:
    """x [T, H, D] (T = batch * L) as the attention hands it over: a [batch, H, L, D] transposed view."""
    T, H, D = x.shape
    return x.reshape(batch, T // batch, H, D).transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------- the cases

@dataclass
class Case:
    """One call: `kernel` is the kernel's class (kernels.yaml's `wrapper` is its `build`), built for
    the backend from `config` (`kernel.context_for(config, backend)`); every output of the native call
    must be within atol + rtol * |reference| of the reference's."""
    label: str
    kernel: type
    config: Any
    args: tuple
    atol: float
    rtol: float


CASES: dict[str, Callable[[], list[Case]]] = {}


def parity(name: str):
    """Registers the function returning kernel `name`'s cases."""
    def register(fn):
        CASES[name] = fn
        return fn
    return register


@parity("rope_pool_fused")
def _rope_pool_fused() -> list[Case]:
    from .kernels.rope_pool_fused import RopePoolFusedKernel as K
    slots = [5, -1, 0, 7, 3, 6]
    cases = [Case(f"{dt}, slot-major pools, {VARIANTS[2 * i]}", K, rope_variant(VARIANTS[2 * i], 64),
                  make_case(6, 8, 2, 64, 8, dt, slots, seed=i), TOL[dt], TOL[dt])
             for i, dt in enumerate(MX_DTYPES)]
    q, k, v, pos, sl, kp, vp = make_case(6, 8, 2, 96, 4, "bfloat16", [0, 5, 2, 7, -1, 3], seed=7, batch=2,
                                         pool_dtype="float32")
    cases.append(Case("bfloat16 [2, H, 3, D] strided views, head-major float32 pools, partial-traditional", K,
                      rope_variant("partial-traditional", 96),
                      (strided(q, 2), strided(k, 2), strided(v, 2), pos, sl, kp, vp), TOL["bfloat16"], TOL["bfloat16"]))
    return cases


@parity("kv_pool_store")
def _kv_pool_store() -> list[Case]:
    from .kernels.kv_pool_store import KvPoolStoreKernel as K
    cases = []
    for i, dt in enumerate(MX_DTYPES):             # a store is exact: one conversion to the pool's dtype
        _, k, v, _, sl, kp, vp = make_case(5, 2, 2, 40, 9, dt, [4, -1, 0, 8, 2], seed=i)
        cases.append(Case(f"{dt}, slot-major pools", K, None, (k, v, sl, kp, vp), 0.0, 0.0))
    _, k, v, _, sl, kp, vp = make_case(6, 2, 2, 40, 3, "float16", [0, 5, 2, -1, 4, 1], seed=3, batch=2,
                                       pool_dtype="bfloat16")
    cases.append(Case("float16 [2, H, 3, D] strided views, head-major bfloat16 pools", K, None,
                      (strided(k, 2), strided(v, 2), sl, kp, vp), 0.0, 0.0))
    return cases


@parity("qk_norm_rope_pool_fused")
def _qk_norm_rope_pool_fused() -> list[Case]:
    from .kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel as K
    from .norm import NormConfig
    norms = (NormConfig(1e-6, 0.0), NormConfig(1e-5, 1.0))        # weight w, and 1 + w (gemma)
    cases = []
    for i, dt in enumerate(MX_DTYPES):
        q, k, v, pos, sl, kp, vp = make_case(6, 8, 2, 64, 8, dt, [5, -1, 0, 7, 3, 6], seed=10 + i,
                                             batch=2 if i % 2 else None)
        w = make_case(1, 1, 1, 64, 1, dt, [0], seed=20 + i)[:2]
        rope, norm = rope_variant(VARIANTS[2 * i + 1], 64), norms[i % 2]
        args = (q, k, v, pos, sl, kp, vp, w[0].reshape(64), w[1].reshape(64))
        if i == 2:
            args = (strided(q, 2), strided(k, 2), strided(v, 2), *args[3:])
        layout = "head-major" if i % 2 else "slot-major"
        cases.append(Case(f"{dt}, {layout} pools{', strided views' if i == 2 else ''}, {VARIANTS[2 * i + 1]}, "
                          f"weight offset {norm.weight_offset:g}", K, (rope, norm), args, 2 * TOL[dt], 2 * TOL[dt]))
    return cases


def _normal(seed: int):
    """(the generator, arr(shape, dtype name): a standard normal array of that dtype)."""
    rng = np.random.default_rng(seed)
    return rng, lambda shape, dt: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[dt])


def i32(x) -> mx.array:
    return mx.array(np.asarray(x, np.int32))


@parity("decode_attention")
def _decode_attention() -> list[Case]:
    from .kernels.decode_attention import DecodeAttentionKernel as K
    rng, arr = _normal(30)
    cases = []
    for i, dt in enumerate(MX_DTYPES):        # head-major caches: left padding, ring order (row 1), GQA
        q = arr((2, 8, 1, 64), dt)
        kp, vp = arr((2, 2, 40, 64), dt), arr((2, 2, 40, 64), dt)
        cases.append(Case(f"{dt}, head-major cache, padded and ring rows", K, None,
                          (q, kp, vp, i32([40, 25]), i32([40, 9]), None, 0.125, 0, 0.0), TOL[dt], TOL[dt]))
    q = arr((3, 4, 12, 96), "bfloat16").transpose(0, 2, 1, 3)      # the attention's transposed view
    kp, vp = arr((64, 4, 96), "bfloat16"), arr((64, 4, 96), "bfloat16")
    table = i32(rng.permutation(64)[:3 * 20].reshape(3, 20))
    cases.append(Case("bfloat16 strided q, slot-major pool through a table, L = 4, window 7, soft-capping", K, None,
                      (q, kp, vp, i32([20, 13, 4]), None, table, 0.1, 7, 30.0), TOL["bfloat16"],
                      TOL["bfloat16"]))
    return cases


def _quant_pools(lead: tuple, H: int, D: int, fmt, dtype: str, seed: int) -> tuple:
    """Random quantized pools of both sides (words, scales, biases each): the slots a store leaves
    must keep them."""
    rng = np.random.default_rng(seed)
    shape = lambda w: (*lead[:-1], H, lead[-1], w) if len(lead) == 2 else (*lead, H, w)
    out = []
    for _ in "kv":
        W, G = fmt.widths(D)[:2]
        out += [mx.array(rng.integers(0, 2**32, shape(W), dtype=np.uint64).astype(np.uint32)),
                mx.array(rng.standard_normal(shape(G)).astype(np.float32)).astype(MX_DTYPES[dtype]),
                mx.array(rng.standard_normal(shape(G)).astype(np.float32)).astype(MX_DTYPES[dtype])]
    return tuple(out)


@parity("kv_quant_pool_store")
def _kv_quant_pool_store() -> list[Case]:
    from .kernels._base import PoolFormat
    from .kernels.kv_quant_pool_store import KvQuantPoolStoreKernel as K
    cases = []                                     # mx.quantize on this device: bit for bit
    for i, (dt, fmt) in enumerate(zip(MX_DTYPES, (PoolFormat(8, 64), PoolFormat(4, 32), PoolFormat(4, 128)))):
        _, k, v, _, sl, _, _ = make_case(5, 2, 2, 128, 8, dt, [4, -1, 0, 7, 2], seed=40 + i)
        lead = (8,) if i != 1 else (2, 4)
        cases.append(Case(f"{dt}, {fmt}, {'head' if i == 1 else 'slot'}-major pools", K, fmt,
                          (k, v, sl, *_quant_pools(lead, 2, 128, fmt, dt, seed=i)), 0.0, 0.0))
    _, k, v, _, sl, _, _ = make_case(6, 2, 2, 64, 3, "bfloat16", [0, 5, 2, -1, 4, 1], seed=43)
    fmt = PoolFormat(8, 32)
    cases.append(Case("bfloat16 [2, H, 3, D] strided views, head-major pools, 8-bit, group size 32", K, fmt,
                      (strided(k, 2), strided(v, 2), sl, *_quant_pools((2, 3), 2, 64, fmt, "bfloat16", seed=4)),
                      0.0, 0.0))
    return cases


@parity("rope_quant_pool_fused")
def _rope_quant_pool_fused() -> list[Case]:
    """At position 0 the rotation is the identity in both paths (cos 1, sin 0): q_out and k_out are the
    inputs exactly, so the pools, mx.quantize of them, are bit for bit the reference's. (At other
    positions the kernel's and MLX's cos/sin may differ in a last bit, which can move a quantized value
    by one step: tests/test_quant_pool_store.py checks those pools against mx.quantize of the kernel's
    own k_out instead.)"""
    from .kernels._base import PoolFormat
    from .kernels.rope_quant_pool_fused import RopeQuantKernel as K
    cases = []
    for i, (dt, fmt) in enumerate(zip(MX_DTYPES, (PoolFormat(4, 64), PoolFormat(8, 128), PoolFormat(8, 32)))):
        q, k, v, _, sl, _, _ = make_case(6, 8, 2, 128, 8, dt, [5, -1, 0, 7, 3, 6], seed=50 + i)
        pos = mx.zeros((6,), dtype=mx.int32)
        lead = (8,) if i != 1 else (2, 4)
        args = (q, k, v, pos, sl, *_quant_pools(lead, 2, 128, fmt, dt, seed=10 + i))
        if i == 2:
            args = (strided(q, 2), strided(k, 2), strided(v, 2), *args[3:])
        cases.append(Case(f"{dt}, {fmt}, {'head' if i == 1 else 'slot'}-major pools"
                          f"{', strided views' if i == 2 else ''}, position 0", K,
                          (rope_variant(VARIANTS[i], 128), None, fmt), args, 0.0, 0.0))
    return cases


@parity("decode_attention_quantized")
def _decode_attention_quantized() -> list[Case]:
    from .kernels._base import PoolFormat
    from .kernels.decode_attention_quantized import DecodeAttentionQuantizedKernel as K
    rng, arr = _normal(60)
    quant = lambda x, fmt: tuple(mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits))
    cases = []
    for dt, fmt in zip(MX_DTYPES, (PoolFormat(8, 64), PoolFormat(4, 32), PoolFormat(4, 128))):
        q = arr((2, 8, 1, 128), dt)
        kp, vp = quant(arr((2, 2, 40, 128), dt), fmt), quant(arr((2, 2, 40, 128), dt), fmt)
        cases.append(Case(f"{dt}, {fmt}, head-major cache, padded and ring rows", K, fmt,
                          (q, kp, vp, i32([40, 25]), i32([40, 9]), None, 0.088, 0, 0.0), TOL[dt], TOL[dt]))
    fmt = PoolFormat(8, 32)
    q = arr((3, 4, 8, 64), "bfloat16").transpose(0, 2, 1, 3)
    kp, vp = quant(arr((64, 2, 64), "bfloat16"), fmt), quant(arr((64, 2, 64), "bfloat16"), fmt)
    table = i32(rng.permutation(64)[:3 * 20].reshape(3, 20))
    cases.append(Case("bfloat16 strided q, slot-major pool through a table, L = 4, window 7, soft-capping", K, fmt,
                      (q, kp, vp, i32([20, 13, 4]), None, table, 0.1, 7, 30.0), TOL["bfloat16"],
                      TOL["bfloat16"]))
    return cases


# ----------------------------------------------------------------------------- running them

@dataclass
class CaseResult:
    label: str
    ok: bool
    max_error: float | None = None      # the largest |native - reference| over every output element
    worst_ratio: float | None = None    # the largest |native - reference| / (atol + rtol * |reference|)
    atol: float = 0.0
    rtol: float = 0.0
    error: str = ""
    seconds: float = 0.0


@dataclass
class KernelResult:
    kernel: str
    verdict: str                        # PASS | FAIL | SKIP
    implementation: str = ""            # native-<backend> | reference | "" (not built)
    reason: str = ""                    # the artifact loaded, or why not; why FAIL or SKIP
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def max_error(self) -> float | None:
        errs = [c.max_error for c in self.cases if c.max_error is not None]
        return max(errs) if errs else None


def run_case(spec, case: Case, backend: str) -> tuple[CaseResult, Any]:
    """(result, the kernel object) of one case: the reference first (evaluated), then the native
    call, which writes the pools passed in place. Any exception is the case's failure."""
    start = time.monotonic()
    res = CaseResult(case.label, False, atol=case.atol, rtol=case.rtol)
    kernel = None
    try:
        kernel = case.kernel.build(spec, case.kernel.context_for(case.config, backend))
        if kernel.implementation != f"native-{backend}":
            res.error = f"runs its reference path, not native-{backend}: {kernel.reason}"
            return res, kernel
        want = kernel.reference(*case.args)
        mx.eval(want)
        got = kernel(*case.args)
        if isinstance(want, mx.array):                   # a kernel of one output (decode_attention)
            want, got = (want,), (got,)
        if len(got) != len(want):
            res.error = f"the native call returned {len(got)} outputs, the reference {len(want)}"
            return res, kernel
        worst = err = 0.0
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or g.dtype != w.dtype:
                res.error = f"output {i}: native {g.dtype} {tuple(g.shape)}, reference {w.dtype} {tuple(w.shape)}"
                return res, kernel
            g64, w64 = to_np(g).astype(np.float64), to_np(w).astype(np.float64)
            diff = np.abs(g64 - w64)
            if not np.isfinite(g64).all():
                res.error = f"output {i}: the native call returned non-finite values"
                return res, kernel
            err = max(err, float(diff.max(initial=0.0)))
            bound = case.atol + case.rtol * np.abs(w64)
            worst = max(worst, float(np.max(np.where(diff == 0, 0.0, diff / np.maximum(bound, 1e-300)), initial=0.0)))
        res.max_error, res.worst_ratio, res.ok = err, worst, worst <= 1.0
    except Exception as e:                               # a check reports, it never raises
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.seconds = time.monotonic() - start
    return res, kernel


def run_kernel(spec, backend: str) -> KernelResult:
    """Every parity case of one kernel of the manifest on `backend`: PASS when each holds on the
    native kernel; SKIP when kernels.yaml declares no target for the backend; FAIL otherwise (no
    parity case, the native kernel unavailable, an error or a mismatch)."""
    if backend not in spec.targets:
        return KernelResult(spec.name, "SKIP", reason=f"kernels.yaml declares no {backend} target for it")
    make = CASES.get(spec.name)
    if make is None:
        return KernelResult(spec.name, "FAIL", reason=f"no parity case: add a function decorated with "
                                                      f"@parity({spec.name!r}) to registry/parity.py "
                                                      f"(docs/manifest.md, \"Adding a kernel\")")
    try:
        cases = make()
    except Exception as e:
        return KernelResult(spec.name, "FAIL", reason=f"its parity cases failed to build: {type(e).__name__}: {e}")
    out = KernelResult(spec.name, "PASS")
    for case in cases:
        res, kernel = run_case(spec, case, backend)
        out.cases.append(res)
        if kernel is not None and not out.implementation:
            out.implementation, out.reason = kernel.implementation, kernel.reason
    failed = [c for c in out.cases if not c.ok]
    if not cases:
        out.verdict, out.reason = "FAIL", "its parity function returned no case"
    elif failed:
        first = failed[0]
        why = first.error or (f"max error {first.max_error:.3g} beyond its tolerance (atol {first.atol:g} + "
                              f"rtol {first.rtol:g} x |reference|)")
        out.verdict, out.reason = "FAIL", f"{len(failed)} of {len(cases)} cases failed; first: {first.label}: {why}"
    return out
