"""The build driver behind `python -m build_tools compile` and setup.py.

One build unit = (kernel, target, arch). Each unit: compute its content key (registry/artifacts.py)
-> under the unit's lock, skip if the index already holds that key with an intact file -> build into
a private temp dir -> check the entry symbols -> move the file into place (content-keyed name) ->
update index.json under the index lock (atomic replace; the commit marker) -> prune superseded files.
Locks are fcntl locks: a killed process releases them, so no stale lock ever blocks a build.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from registry import envs
from registry.artifacts import (IndexEntry, build_key, default_output_dir, read_index, sha256_file,
                                source_digest, write_index)
from registry.manifest import TARGETS, KernelSpec, Manifest, load_manifest

from . import symbols, toolchains

Log = Callable[[str], None]


class BuildError(Exception):
    """A compiler failed: carries the exact command, its output and the source."""

    def __init__(self, unit: str, command: list[str], output: str, sources: list[str]):
        self.command, self.output, self.sources = command, output, sources
        super().__init__(f"{unit}: build failed\n  sources: {', '.join(sources)}\n  command: "
                         f"{' '.join(command)}\n{output.rstrip()}")


class MissingToolchainError(Exception):
    """A target was asked for explicitly but its toolchain is missing (exit code 2)."""


class LockTimeoutError(Exception):
    pass


@dataclass
class UnitResult:
    kernel: str
    target: str
    arch: str | None
    status: str                       # built | fresh | failed | planned
    seconds: float = 0.0
    path: str | None = None
    key: str | None = None
    message: str = ""
    commands: list[list[str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.target}" + (f" {self.arch}" if self.arch else "")


@dataclass
class CompileReport:
    out_dir: str
    results: list[UnitResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # what was not built -> why

    @property
    def ok(self) -> bool:
        return all(r.status != "failed" for r in self.results)

    def to_json(self) -> dict:
        return {"out_dir": self.out_dir, "ok": self.ok, "results": [asdict(r) for r in self.results],
                "skipped": self.skipped}


# ----------------------------------------------------------------------------- locks

@contextmanager
def file_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    timeout = envs.get_float("MLX_AOT_LOCK_TIMEOUT") if timeout is None else timeout
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"timed out after {timeout:g}s waiting for the build lock {path}: another "
                        f"`python -m build_tools compile` holds it (raise MLX_AOT_LOCK_TIMEOUT to wait longer)"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- planning

@dataclass(frozen=True)
class Unit:
    spec: KernelSpec
    target: str
    arch: str | None

    @property
    def kind(self) -> str:
        if self.target == "cpu":
            return "so"
        if self.target == "metal":
            return "metallib"
        return "ptx" if self.arch.startswith("compute_") else "cubin"

    @property
    def slot(self) -> tuple[str, str, str | None]:
        return (self.spec.name, self.target, self.arch)

    def file_name(self, key: str) -> str:
        arch = f".{self.arch}" if self.arch else ""
        return f"{self.spec.name}.{key[:16]}{arch}.{self.kind}"

    @property
    def label(self) -> str:
        return f"{self.spec.name} {self.target}" + (f" {self.arch}" if self.arch else "")


def resolve_targets(requested: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Targets to build and, for `auto`, what was skipped and why. Explicitly requested targets
    whose toolchain is missing raise MissingToolchainError carrying the fix."""
    skipped: dict[str, str] = {}
    chosen: list[str] = []
    explicit = [t for t in requested if t not in ("auto", "all")]
    if "all" in requested:
        explicit = list(TARGETS)
    for t in explicit:
        if t not in TARGETS:
            raise ValueError(f"unknown target {t!r}; choose from auto, all, {', '.join(TARGETS)}")
        tc = toolchains.find(t)
        if not tc.available:
            raise MissingToolchainError(f"target {t}: {tc.detail}. Fix: {tc.fix}")
        chosen.append(t)
    if "auto" in requested:
        for t in TARGETS:
            tc = toolchains.find(t)
            if tc.available:
                if t not in chosen:
                    chosen.append(t)
            else:
                skipped[t] = f"{tc.detail} (fix: {tc.fix})"
    return chosen, skipped


def plan(manifest: Manifest, targets: list[str], only: list[str] | None,
         archs: list[str] | None) -> tuple[list[Unit], dict[str, str]]:
    skipped: dict[str, str] = {}
    specs = list(manifest.kernels)
    if only:
        names = {k.name for k in specs}
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"--only: unknown kernel(s) {', '.join(unknown)}; declared: {', '.join(sorted(names))}")
        specs = [k for k in specs if k.name in only]
    units: list[Unit] = []
    for spec in specs:
        for t in targets:
            if t not in spec.targets:
                skipped[f"{spec.name} {t}"] = f"kernel declares no {t} sources"
                continue
            if t == "cuda":
                tspec = spec.targets[t]
                wanted = archs or list(tspec.archs)
                if not wanted:
                    skipped[f"{spec.name} cuda"] = "no cuda.archs in the manifest and no --arch given"
                for a in wanted:
                    units.append(Unit(spec, t, a))
                if tspec.ptx_arch and not archs:
                    units.append(Unit(spec, t, tspec.ptx_arch))
            else:
                units.append(Unit(spec, t, None))
    return units, skipped


# ----------------------------------------------------------------------------- commands

def _includes(unit: Unit) -> list[str]:
    return [f"-I{p}" for p in unit.spec.include_paths(unit.target)]


def commands(unit: Unit, tmp: Path, tc: toolchains.Toolchain) -> tuple[list[list[str]], Path]:
    """The exact argv list for one unit and the file it produces in `tmp`."""
    spec, tspec = unit.spec, unit.spec.targets[unit.target]
    sources = [str(p) for p in spec.source_paths(unit.target)]
    out = tmp / f"{spec.name}.{unit.kind}"
    if unit.target == "cpu":
        return [[*tc.command, "-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", *_includes(unit),
                 *tspec.flags, *sources, "-o", str(out)]], out
    if unit.target == "cuda":
        if len(sources) != 1:
            raise BuildError(unit.label, [], f"cuda.sources must list exactly one translation unit (the launcher "
                                             f"loads one module); got {len(sources)}: put shared code in headers",
                             sources)
        mode = "-ptx" if unit.kind == "ptx" else "-cubin"
        return [[*tc.command, mode, f"-arch={unit.arch}", "-O3", "-std=c++17", *_includes(unit), *tspec.flags,
                 sources[0], "-o", str(out)]], out
    cmds, airs = [], []
    for i, src in enumerate(sources):
        air = tmp / f"{i}_{Path(src).stem}.air"
        airs.append(str(air))
        cmds.append([*tc.command, "metal", f"-std={tspec.std}", "-O3", f"-mmacosx-version-min={tspec.macos_min}",
                     *_includes(unit), *tspec.flags, "-MMD", "-MF", f"{air}.d", "-c", src, "-o", str(air)])
    cmds.append([*tc.command, "metallib", *airs, "-o", str(out)])
    return cmds, out


def _flags_for_key(unit: Unit) -> list[str]:
    tspec = unit.spec.targets[unit.target]
    return [*tspec.flags, f"std={tspec.std}", f"macos_min={tspec.macos_min}"] if unit.target == "metal" \
        else list(tspec.flags)


# ----------------------------------------------------------------------------- building one unit

def _run(cmd: list[str], unit: Unit, log: Log | None, verbose: bool) -> None:
    if verbose and log:
        log("  $ " + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if verbose and log and (p.stdout or p.stderr):
        log((p.stdout + p.stderr).rstrip())
    if p.returncode != 0:
        raise BuildError(unit.label, cmd, f"exit code {p.returncode}\n{p.stdout}{p.stderr}",
                         [str(s) for s in unit.spec.source_paths(unit.target)])


def build_unit(unit: Unit, out_dir: Path, *, force: bool, dry_run: bool, verbose: bool,
               log: Log | None) -> UnitResult:
    start = time.monotonic()
    tc = toolchains.find(unit.target)
    digest = source_digest(unit.spec, unit.target)
    key = build_key(digest, tc.identity, _flags_for_key(unit), unit.arch)
    res = UnitResult(unit.spec.name, unit.target, unit.arch, "fresh", key=key)

    def fresh() -> IndexEntry | None:
        entry = read_index(out_dir)[0].get(unit.slot)
        if entry and entry.key == key and (out_dir / entry.file).is_file() and \
                sha256_file(out_dir / entry.file) == entry.sha256:
            return entry
        return None

    if dry_run:
        cmds, _ = commands(unit, out_dir / ".tmp-dry-run", tc)
        res.commands = cmds
        res.status = "fresh" if (not force and fresh()) else "planned"
        return res

    lock = out_dir / ".locks" / f"{unit.spec.name}.{unit.target}.{unit.arch or 'any'}.lock"
    with file_lock(lock):
        entry = None if force else fresh()   # re-check under the lock: another process may have built it
        if entry is not None:
            res.path = str(out_dir / entry.file)
            res.seconds = time.monotonic() - start
            return res
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{unit.spec.name}-", dir=out_dir))
        try:
            cmds, produced = commands(unit, tmp, tc)
            res.commands = cmds
            for cmd in cmds:
                _run(cmd, unit, log, verbose)
            wanted = list(unit.spec.entries.values())
            missing = symbols.missing_entries(produced, unit.kind, wanted)
            if missing:
                raise BuildError(unit.label, cmds[-1], f"the artifact lacks the entry symbol(s) {', '.join(missing)} "
                                                        f"declared in kernels.yaml `entries` (extern \"C\"?)",
                                 [str(s) for s in unit.spec.source_paths(unit.target)])
            rel = Path(unit.spec.name) / unit.target / unit.file_name(key)
            final = out_dir / rel
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(produced, final)
            new = IndexEntry(kernel=unit.spec.name, target=unit.target, arch=unit.arch, file=rel.as_posix(),
                             sha256=sha256_file(final), key=key, source_digest=digest,
                             entries=dict(unit.spec.entries), compiler=tc.identity, flags=_flags_for_key(unit))
            with file_lock(out_dir / ".lock"):
                index, _ = read_index(out_dir)
                old = index.get(unit.slot)
                index[unit.slot] = new
                write_index(out_dir, index)
            if old is not None and old.file != new.file:
                (out_dir / old.file).unlink(missing_ok=True)   # superseded; the index no longer names it
            res.status, res.path = "built", str(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    res.seconds = time.monotonic() - start
    return res


# ----------------------------------------------------------------------------- entry point

def compile_kernels(targets: tuple[str, ...] | list[str] = ("auto",), out_dir: str | Path | None = None,
                    only: list[str] | None = None, archs: list[str] | None = None, force: bool = False,
                    jobs: int | None = None, dry_run: bool = False, verbose: bool = False,
                    log: Log | None = None, manifest: str | Path | Manifest | None = None) -> CompileReport:
    """Compile the manifest's kernels for `targets` ('auto', 'all', 'metal', 'cuda', 'cpu').

    Raises MissingToolchainError for an explicitly requested target without its toolchain,
    ValueError for bad arguments; build failures are reported in the result (status 'failed')."""
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    out = Path(out_dir) if out_dir is not None else default_output_dir()
    chosen, skipped = resolve_targets(tuple(targets))
    for a in archs or []:
        if not (a.startswith("sm_") or a.startswith("compute_")):
            raise ValueError(f"--arch: {a!r} is not a CUDA arch like sm_90 or compute_80")
    units, plan_skipped = plan(m, chosen, only, archs)
    skipped.update(plan_skipped)
    report = CompileReport(out_dir=str(out), skipped=skipped)
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
    n = len(units)

    def one(i_unit: tuple[int, Unit]) -> UnitResult:
        i, unit = i_unit
        try:
            r = build_unit(unit, out, force=force, dry_run=dry_run, verbose=verbose, log=log)
        except BuildError as e:
            r = UnitResult(unit.spec.name, unit.target, unit.arch, "failed", message=str(e),
                           commands=[e.command] if e.command else [])
        except LockTimeoutError as e:
            r = UnitResult(unit.spec.name, unit.target, unit.arch, "failed", message=str(e))
        if log:
            log(f"[{i}/{n}] {r.label:<34} {r.status:<7} {r.seconds:6.2f}s" + (f"  {r.path}" if r.path and verbose else ""))
            if r.status == "failed":
                log(r.message)
            if dry_run:
                for cmd in r.commands:
                    log("  $ " + " ".join(cmd))
        return r

    workers = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        report.results = list(pool.map(one, enumerate(units, 1)))
    return report
