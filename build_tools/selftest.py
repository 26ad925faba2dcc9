"""`python -m build_tools selftest`: does this machine build and run every kernel right?

1. compile the manifest's kernels for the backend of MLX's default device (cpu, cuda for the
   device's sm_XX, or metal), as `compile --target <backend>` does;
2. run every kernel's parity cases (registry/parity.py): its native kernel against its pure-MLX
   reference path, per case the largest error and the tolerance;
3. decode a tiny random-weight llama-like model (float32) with mlx-lm's generate_step, once with the
   drop-in cache (registry.integrations.mlx_lm.make_prompt_cache) and once with mlx-lm's own caches:
   the same tokens, and the ratio of their decode speeds.

Every check catches its own exceptions and reports them as a failure; `run()` returns the report
(what `--json` writes, for a bug report) and never raises.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
import traceback
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Callable

DECODE_PROMPT = [3, 17, 42, 99, 7, 11, 5, 8, 200, 1, 64, 33, 2, 150, 77, 9]
DECODE_TOKENS = 32
DECODE_ROUNDS = 3


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _error(e: BaseException) -> str:
    """An exception as one line, with where it was raised (for the bug report; never a traceback)."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def environment() -> dict:
    import mlx.core as mx

    from registry.core import backend_of
    info = {"host": platform.node(), "os": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "mlx": mx.__version__, "mlx_lm": _version("mlx-lm"),
            "mlx_aot_kernels": _version("mlx-aot-kernels"), "backend": backend_of(None),
            "device": str(mx.default_device())}
    try:
        info["device_name"] = mx.device_info().get("device_name")
    except Exception as e:                                   # informational only
        info["device_name"] = f"unknown ({_error(e)})"
    return info


def _cuda_arch() -> tuple[str | None, str]:
    """(the device's sm_XX, "") or (None, why not)."""
    from registry.errors import NativeUnavailableError
    from registry.native import import_ext
    try:
        arch = import_ext().cuda_device_arch(0)
    except NativeUnavailableError as e:
        return None, str(e)
    return (arch, "") if arch else (None, "registry._ext was built without CUDA support")


def compile_step(manifest, backend: str, out_dir: Path | None, log: Callable[[str], None]) -> dict:
    """compile_kernels for `backend` (cuda: the device's arch only). status: built (or fresh), failed (a
    unit failed to build: a FAIL), unavailable (no toolchain or arch: the kernels then run whatever
    artifacts are already there, which their checks judge)."""
    from .compiler import MissingToolchainError, compile_kernels
    archs = None
    if backend == "cuda":
        arch, why = _cuda_arch()
        if arch is None:
            return {"status": "unavailable", "message": f"cannot tell the device's CUDA arch: {why}"}
        archs = [arch]
    try:
        report = compile_kernels(targets=(backend,), out_dir=out_dir, archs=archs, manifest=manifest, log=log)
    except MissingToolchainError as e:
        return {"status": "unavailable", "message": f"{e} (the checks below use the artifacts already built)"}
    except Exception as e:
        return {"status": "failed", "message": _error(e)}
    failed = [r for r in report.results if r.status == "failed"]
    return {"status": "failed" if failed else "ok", "out_dir": report.out_dir, "counts": report.counts(),
            "seconds": round(report.seconds, 3), "skipped": report.skipped,
            "message": failed[0].message if failed else "", "results": [asdict(r) for r in report.results]}


def artifact_step(manifest, backend: str, dirs: list[Path]) -> list[dict]:
    """The registry's view of every artifact of the backend (for cuda: of the device's arch)."""
    from .compiler import artifact_states
    arch = _cuda_arch()[0] if backend == "cuda" else None
    return [asdict(s) for s in artifact_states(manifest, dirs)
            if s.target == backend and (arch is None or s.arch in (arch, None))]


@contextlib.contextmanager
def _env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare_tokens(got: list[int], got_lps, want: list[int], want_lps) -> tuple[bool, str, float]:
    """(ok, what, largest log-prob difference over the steps compared). Tokens must be identical; a
    first difference is accepted only where stock's top two log-probs were closer than the largest
    difference of the two runs' log-probs up to there (a near-tie: GPUs round float32 matmuls
    differently, e.g. TF32), and the comparison stops there."""
    import numpy as np
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        worst = max(worst, float(np.abs(got_lps[i] - want_lps[i]).max()))
        if g != w:
            top2 = np.sort(want_lps[i])[-2:]
            gap = float(top2[1] - top2[0])
            if gap <= 2 * worst:
                return True, f"tokens identical for {i} steps, then a near-tie (stock's top-2 gap {gap:.2g})", worst
            return False, f"step {i}: token {g}, stock {w} (stock's top-2 gap {gap:.3g}, log-probs {worst:.3g} apart)", worst
    if len(got) != len(want):
        return False, f"{len(got)} tokens, stock {len(want)}", worst
    return True, f"{len(want)} tokens identical", worst


def decode_check(manifest) -> dict:
    """The drop-in cache against mlx-lm's own caches in mlx-lm's generate_step (see the module doc).
    Each kernel's enable flag is forced on for the check (kernels.yaml's `prefer` may keep a kernel
    off on a backend with no measured win), so the drop-in runs the kernels wherever they build."""
    if _version("mlx-lm") is None:
        return {"verdict": "SKIP", "message": "mlx-lm is not installed (pip install mlx-lm==0.32.2): the drop-in "
                                              "cache needs it"}
    import importlib

    import mlx.core as mx
    import numpy as np

    from registry.integrations import mlx_lm_cache as mc
    from registry.integrations.coverage import ARCHS
    from registry.integrations.mlx_lm import build_model, import_mlx_lm_module, make_prompt_cache

    stock = import_mlx_lm_module("cache")
    gen = importlib.import_module("mlx_lm.generate")
    forced = {k.enable.env: "1" for k in manifest.kernels}
    mx.random.seed(0)
    model = build_model(ARCHS["llama"], dtype=mx.float32)
    prompt = mx.array(DECODE_PROMPT)

    def generate(make, with_logprobs: bool):
        toks, lps, start = [], [], None
        steps = gen.generate_step(prompt, model, max_tokens=DECODE_TOKENS, prompt_cache=make(model))
        for i, (t, lp) in enumerate(steps):
            if i == 0:
                start = time.perf_counter()      # decode speed: the tokens after the first (the prefill's)
            toks.append(int(t))
            if with_logprobs:
                lps.append(np.array(lp.astype(mx.float32)))
        return toks, lps, (len(toks) - 1) / (time.perf_counter() - start)

    with _env(forced):
        make_prompt_cache(model)                  # the kernel sets: traced once, with the flags forced on
    fm = mc.fused_model(model)
    kernels = sorted({f"{f.kernel.NAME} ({f.kernel.implementation})" for f in fm.fusions.values()})
    got, got_lps, _ = generate(make_prompt_cache, True)
    want, want_lps, _ = generate(stock.make_prompt_cache, True)
    ok, what, worst = compare_tokens(got, got_lps, want, want_lps)
    ratios, speeds = [], {"drop-in": [], "stock": []}
    for _ in range(DECODE_ROUNDS):               # interleaved: both see the machine's same moments
        a, b = generate(make_prompt_cache, False)[2], generate(stock.make_prompt_cache, False)[2]
        speeds["drop-in"].append(a)
        speeds["stock"].append(b)
        ratios.append(a / b)
    if not fm.fusions:
        ok, what = False, f"no layer fused: {'; '.join(fm.reasons.values()) or fm.explain()}"
    return {"verdict": "PASS" if ok else "FAIL", "message": what, "model": "tiny llama (coverage.ARCHS['llama']), "
            "float32, random weights", "prompt_tokens": len(DECODE_PROMPT), "tokens": DECODE_TOKENS,
            "fused_layers": sorted(fm.fusions), "kernels": kernels, "max_logprob_diff": worst,
            "tokens_dropin": got, "tokens_stock": want, "speed_ratio": statistics.median(ratios),
            "decode_tokens_per_s": {k: statistics.median(v) for k, v in speeds.items()},
            "rounds": DECODE_ROUNDS, "forced_enable_flags": sorted(forced)}


def _guard(name: str, fn: Callable, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:
        return {"verdict": "FAIL", "message": f"{name}: {_error(e)}"}


def run(out_dir: Path | None = None, manifest=None, log: Callable[[str], None] = lambda s: None) -> dict:
    """The whole self-check: the report `--json` writes; report['ok'] when every check passed."""
    report: dict = {"ok": False, "checks_failed": []}
    try:
        report["environment"] = environment()
        backend = report["environment"]["backend"]
        from registry.artifacts import artifact_dirs
        from registry.manifest import Manifest, load_manifest
        from registry.parity import run_kernel
        m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
        report["manifest"] = str(m.path)
        with _env({"MLX_AOT_CACHE_DIR": str(Path(out_dir).absolute())} if out_dir is not None else {}):
            report["compile"] = compile_step(m, backend, out_dir, log)
            report["artifacts"] = _guard("artifacts", artifact_step, m, backend, artifact_dirs())
            report["kernels"] = []
            for spec in m.kernels:
                r = run_kernel(spec, backend)
                report["kernels"].append({**asdict(r), "max_error": r.max_error})
            report["decode"] = _guard("decode check", decode_check, m)
    except Exception as e:                      # outside any check: the report says where
        report["error"] = _error(e)
        report["checks_failed"].append("selftest")
        return report
    failed = report["checks_failed"]
    if report["compile"]["status"] == "failed":
        failed.append("compile")
    failed += [k["kernel"] for k in report["kernels"] if k["verdict"] == "FAIL"]
    if report["decode"].get("verdict") == "FAIL":
        failed.append("decode")
    report["ok"] = not failed
    return report


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def _tolerance(case: dict) -> str:
    if not case["atol"] and not case["rtol"]:
        return "exact"
    return f"atol {case['atol']:g} + rtol {case['rtol']:g} x |reference|"


def summary(report: dict) -> list[str]:
    """The report as the lines `selftest` prints."""
    env = report.get("environment", {})
    lines = [f"mlx-aot-kernels selftest on {env.get('host', '?')} ({env.get('os', '?')}): MLX {env.get('mlx', '?')}, "
             f"mlx-lm {env.get('mlx_lm') or 'not installed'}, backend {env.get('backend', '?')} "
             f"({env.get('device_name', '?')})"]
    if "error" in report:
        return lines + [f"FAIL selftest: {report['error']}"]
    c = report["compile"]
    counts = ", ".join(f"{v} {k}" for k, v in c.get("counts", {}).items()) or "nothing to build"
    lines.append({"ok": f"compile: {counts} in {c.get('seconds', 0):.2f}s -> {c.get('out_dir')}",
                  "failed": f"FAIL compile: {c.get('message', '')}",
                  "unavailable": f"compile: not run: {c.get('message', '')}"}[c["status"]])
    for k in report["kernels"]:
        head = f"{k['verdict']} {k['kernel']}"
        if k["verdict"] == "SKIP" or not k["cases"]:
            lines.append(f"{head}: {k['reason']}")
            continue
        worst = max(k["cases"], key=lambda c: c["worst_ratio"] if c["worst_ratio"] is not None else float("inf"))
        lines.append(f"{head}: {k['implementation'] or 'not built'}, {len(k['cases'])} cases against the "
                     f"reference, max error {_g(k['max_error'])} (the case nearest its tolerance: "
                     f"{_g(worst['max_error'])}, tolerance {_tolerance(worst)})")
        lines.append(f"     {k['reason']}")
    d = report["decode"]
    if d.get("verdict") == "SKIP" or "speed_ratio" not in d:
        lines.append(f"{d.get('verdict', 'FAIL')} decode: {d.get('message', '')}")
    else:
        tps = d["decode_tokens_per_s"]
        lines.append(f"{d['verdict']} decode (drop-in cache vs mlx-lm's own, generate_step, {d['model']}; "
                     f"{', '.join(d['kernels'])}): {d['message']}, log-probs within {_g(d['max_logprob_diff'])}; "
                     f"decode speed {d['speed_ratio']:.2f}x stock ({tps['drop-in']:.0f} vs {tps['stock']:.0f} "
                     f"tokens/s, median of {d['rounds']} rounds)")
    failed = report["checks_failed"]
    lines.append(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "all checks passed")
    return lines
