"""The build driver behind `python -m build_tools compile` and setup.py: `compile_kernels()`.

Per build unit (kernel, target, arch; build_tools/commands.py):
  1. key = build_key(source digest, compiler identity, exact commands, arch)   (registry/artifacts.py)
  2. fresh if the index holds that key with an intact file -> done, no lock taken (a no-op run costs
     one index read and one hash per artifact)
  3. else take the unit's lock, re-check (another process may just have built it), remove leftovers
     of killed builds, build in a private temp dir, check the compiler's dependency files against
     the include scan, check entry symbols (and the cubin's SM), re-hash the sources (changed while
     compiling -> fail), move the file into place under its content-keyed name, update index.json
     under the index lock (atomic replace: the commit marker), prune superseded files of the unit.
A process killed at any step leaves a temp dir or an unindexed file: nothing the registry loads.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from registry import envs
from registry._version import __version__
from registry.artifacts import (IndexEntry, UnsafeFile, build_key, check_entry, default_output_dir, dependency_files,
                                parse_cuda_arch, read_index, sha256_file, source_inputs, write_index)
from registry.manifest import TARGETS, Manifest, load_manifest

from . import symbols, toolchains
from .commands import Unit, key_commands, parse_depfile, recipe
from .locking import LockTimeoutError, file_lock

Log = Callable[[str], None]
INDEX_LOCK = ".lock"
_TAG = re.compile(r"^[a-z_][a-z0-9_]*\.(cpu|cuda|metal)\.[a-z0-9_]+$")   # Unit.tag
UNIT_LOCKS = ".locks"
TMP_PREFIX = ".tmp-"


class BuildError(Exception):
    """A unit failed to build: carries the exact command, the compiler's output and the sources."""

    def __init__(self, unit: str, command: list[str] | None, output: str, sources: list[str]):
        self.command, self.output, self.sources = command, output, sources
        cmd = f"\n  command: {shlex.join(command)}" if command else ""
        super().__init__(f"{unit}: build failed\n  sources: {', '.join(sources)}{cmd}\n{output.rstrip()}")


class MissingToolchainError(Exception):
    """A target was asked for explicitly but its toolchain is missing (CLI exit code 2); says the fix."""


@dataclass
class UnitResult:
    kernel: str
    target: str
    arch: str | None
    status: str                       # built | fresh | failed | planned (dry run)
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
    targets: list[str] = field(default_factory=list)
    results: list[UnitResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # what was not built -> why (and the fix)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.status != "failed" for r in self.results)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def to_json(self) -> dict:
        return {"out_dir": self.out_dir, "ok": self.ok, "targets": self.targets, "seconds": round(self.seconds, 3),
                "counts": self.counts(), "results": [asdict(r) for r in self.results], "skipped": self.skipped}


def lock_timeout() -> float:
    return envs.get_float("MLX_AOT_LOCK_TIMEOUT")


# ----------------------------------------------------------------------------- planning

def _split(values: str | Iterable[str] | None) -> list[str]:
    """'a,b' / ['a', 'b,c'] -> ['a', 'b', 'c'] (CLI lists and Python lists alike), order kept, no dups."""
    if values is None:
        return []
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        for v in str(item).replace(",", " ").split():
            if v not in out:
                out.append(v)
    return out


def resolve_targets(requested: Iterable[str], *, dry_run: bool = False) -> tuple[list[str], dict[str, str]]:
    """Targets to build and what `auto`/`all` skipped, and why (with the fix).

    auto  the targets this machine runs (toolchains.runs: the installed MLX's backends and devices)
          whose toolchain is here
    all   every target whose toolchain is here, whatever this machine runs (wheels, other hosts)
    A target named explicitly whose toolchain is missing raises MissingToolchainError carrying the
    fix, except in a dry run, which plans its commands anyway (what a Linux user or CI wants to see
    of Metal)."""
    requested = _split(requested)
    if not requested:
        raise ValueError(f"targets: empty; choose from auto, all, {', '.join(TARGETS)}")
    for t in requested:
        if t not in ("auto", "all", *TARGETS):
            raise ValueError(f"targets: unknown target {t!r}; choose from auto, all, {', '.join(TARGETS)}")
    chosen = [t for t in requested if t in TARGETS]
    missing = [f"target {t}: {tc.detail}\n  fix: {tc.fix}" for t in chosen
               if not (tc := toolchains.find(t)).available and not dry_run]
    if missing:
        raise MissingToolchainError("\n".join(missing))
    skipped: dict[str, str] = {}
    if "auto" in requested or "all" in requested:
        for t in TARGETS:
            if t in chosen:
                continue
            tc = toolchains.find(t)
            elsewhere = "" if "all" in requested else toolchains.runs(t)
            if elsewhere:   # where the toolchain is here too, say how to build for other machines
                skipped[t] = elsewhere + (f"; `--target {t}` or `--target all` builds it for other machines"
                                          if tc.available else "")
            elif not tc.available:
                skipped[t] = f"{tc.detail} (fix: {tc.fix})"
            else:
                chosen.append(t)
    return [t for t in TARGETS if t in chosen], skipped


def plan(manifest: Manifest, targets: list[str], only: list[str] | None = None,
         archs: list[str] | None = None) -> tuple[list[Unit], dict[str, str]]:
    """Build units for `targets`; cuda: each manifest arch plus its ptx_arch, or exactly `archs`."""
    skipped: dict[str, str] = {}
    specs = list(manifest.kernels)
    if only:
        names = [k.name for k in specs]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"only: unknown kernel(s) {', '.join(unknown)} in {manifest.path}; "
                             f"declared: {', '.join(names)}")
        specs = [k for k in specs if k.name in only]
    units: list[Unit] = []
    for spec in specs:
        for t in targets:
            if t not in spec.targets:
                skipped[f"{spec.name} {t}"] = f"kernel declares no {t} sources"
                continue
            if t != "cuda":
                units.append(Unit(spec, t, None))
                continue
            tspec = spec.targets[t]
            wanted = list(archs) if archs else [*tspec.archs, *([tspec.ptx_arch] if tspec.ptx_arch else [])]
            if not wanted:
                skipped[f"{spec.name} cuda"] = "no cuda.archs/ptx_arch in the manifest and no --arch given"
            units.extend(Unit(spec, t, a) for a in wanted)
    return units, skipped


# ----------------------------------------------------------------------------- one unit

@dataclass(frozen=True)
class _Options:
    out: Path
    force: bool
    dry_run: bool
    verbose: bool
    log: Log | None
    timeout: float


def _sources(unit: Unit) -> list[str]:
    return [str(p) for p in unit.sources()]


def _run(cmd: list[str], unit: Unit, opts: _Options) -> None:
    """Run one compiler command; --verbose streams the command and its output as it comes."""
    say = opts.log if (opts.verbose and opts.log) else None
    if say:
        say(f"  [{unit.label}] $ {shlex.join(cmd)}")
    try:
        p = subprocess.Popen(cmd, cwd=unit.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace")
    except OSError as e:
        raise BuildError(unit.label, cmd, f"cannot run {cmd[0]}: {e}", _sources(unit)) from None
    lines = []
    with p:
        for line in p.stdout:
            lines.append(line)
            if say:
                say(f"  [{unit.label}] {line.rstrip()}")
    if p.returncode != 0:
        raise BuildError(unit.label, cmd, f"exit code {p.returncode}\n{''.join(lines)}", _sources(unit))


def _check_dependencies(unit: Unit, depfiles: list[Path], cmd: list[str]) -> None:
    """Every project file the compiler read must be one the include scan hashes, or edits to it
    would not change the artifact's digest (e.g. an `#include MACRO`)."""
    scanned = set(dependency_files(unit.spec, unit.target))
    missed: list[str] = []
    for dep in depfiles:
        if not dep.is_file():
            raise BuildError(unit.label, cmd, f"the compiler did not write its dependency file {dep}", _sources(unit))
        for p in parse_depfile(dep, unit.root):
            if p.is_relative_to(unit.root) and p not in scanned and p.is_file() and str(p) not in missed:
                missed.append(str(p))
    if missed:
        raise BuildError(unit.label, cmd, f"the compiler read {', '.join(missed)}, which the include scan does not "
                                          f"reach, so editing it would not mark the artifact stale. Include it with "
                                          f"a literal #include \"...\" (or <...> inside include_dirs).", _sources(unit))


def _check_output(unit: Unit, path: Path, cmd: list[str]) -> None:
    wanted = list(dict.fromkeys(unit.spec.entries.values()))
    try:
        missing = symbols.missing_entries(path, unit.kind, wanted)
        sm = symbols.cubin_sm(path) if unit.kind == "cubin" else None
    except (OSError, ValueError) as e:
        raise BuildError(unit.label, cmd, f"cannot read the artifact: {e}", _sources(unit)) from None
    if missing:
        how = {"so": "exported from the shared library (extern \"C\" with default visibility)",
               "cubin": "in the cubin's symbol table (extern \"C\" __global__)",
               "ptx": "an .entry of the PTX (extern \"C\" __global__)",
               "metallib": "a function of the metallib ([[kernel]] with [[host_name(...)]])"}[unit.kind]
        raise BuildError(unit.label, cmd, f"entry symbol(s) {', '.join(missing)} declared in kernels.yaml `entries` "
                                          f"are not {how}", _sources(unit))
    if sm is not None and sm != parse_cuda_arch(unit.arch)[1]:
        raise BuildError(unit.label, cmd, f"the cubin targets sm_{sm}, not {unit.arch}", _sources(unit))


def _fresh(unit: Unit, out: Path, key: str, inputs) -> IndexEntry | None:
    """The index entry if it has this key and passes every check the registry makes."""
    entry = read_index(out)[0].get(unit.slot)
    if entry is None or entry.key != key:
        return None
    return entry if check_entry(out, entry, inputs, unit.spec) is None else None


def _remove_leftovers(unit: Unit, out: Path) -> None:
    """Temp dirs of this unit's killed builds. Only the holder of the unit lock creates them, so
    under that lock every one found belongs to a dead build."""
    for p in out.glob(f"{TMP_PREFIX}{unit.tag}-*"):
        shutil.rmtree(p, ignore_errors=True)


def _prune(unit: Unit, out: Path, keep: str) -> None:
    """Superseded files and orphans of killed builds (moved into place, never indexed) of this unit."""
    d = out / unit.rel_dir()
    pattern = unit.file_pattern()
    for p in d.iterdir():
        if p.name != keep and pattern.match(p.name):
            p.unlink(missing_ok=True)


def build_unit(unit: Unit, opts: _Options) -> UnitResult:
    start = time.monotonic()
    out = opts.out
    tc = toolchains.find(unit.target)
    if opts.dry_run and not tc.available:   # plan with the usual command names; nothing is run
        res = UnitResult(unit.spec.name, unit.target, unit.arch, "planned",
                         message=f"not buildable here ({tc.detail}); the commands a machine with the toolchain runs",
                         commands=recipe(unit, out / f"{TMP_PREFIX}{unit.tag}-dry-run",
                                         toolchains.planned(unit.target)).commands)
        res.seconds = time.monotonic() - start
        return res
    try:
        inputs = source_inputs(unit.spec, unit.target)
    except UnsafeFile as e:   # an #include of a FIFO or device, which would block the compiler
        raise BuildError(unit.label, None, str(e), _sources(unit)) from None
    try:
        key_cmds = key_commands(unit, tc)
    except ValueError as e:
        raise BuildError(unit.label, None, str(e), _sources(unit)) from None
    key = build_key(inputs.digest, tc.identity, key_cmds, unit.arch)
    res = UnitResult(unit.spec.name, unit.target, unit.arch, "fresh", key=key)

    def done(status: str, path: Path | None) -> UnitResult:
        res.status, res.path, res.seconds = status, str(path) if path else None, time.monotonic() - start
        return res

    entry = None if opts.force else _fresh(unit, out, key, inputs)
    if entry is not None:
        return done("fresh", out / entry.file)
    if opts.dry_run:
        res.commands = recipe(unit, out / f"{TMP_PREFIX}{unit.tag}-dry-run", tc).commands
        return done("planned", None)

    with file_lock(out / UNIT_LOCKS / f"{unit.tag}.lock", opts.timeout):
        entry = None if opts.force else _fresh(unit, out, key, inputs)
        if entry is not None:   # another process built it while we waited for the lock
            return done("fresh", out / entry.file)
        _remove_leftovers(unit, out)
        build_dir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{unit.tag}-", dir=out))
        try:
            r = recipe(unit, build_dir, tc)
            res.commands = r.commands
            for cmd in r.commands:
                _run(cmd, unit, opts)
            _check_dependencies(unit, r.depfiles, r.commands[0])
            _check_output(unit, r.output, r.commands[-1])
            if source_inputs(unit.spec, unit.target).digest != inputs.digest:
                raise BuildError(unit.label, None, "the sources changed while compiling; run compile again",
                                 _sources(unit))
            final = out / unit.rel_dir() / unit.file_name(key)
            if not _inside(out, final.parent):   # never write (or prune) through a symlink
                raise BuildError(unit.label, None, f"refused: {out / unit.rel_dir()} is or passes through a "
                                                   f"symlink; remove it", _sources(unit))
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(r.output, final)
            new = IndexEntry(kernel=unit.spec.name, target=unit.target, arch=unit.arch,
                             file=(unit.rel_dir() / final.name).as_posix(), sha256=sha256_file(final),
                             size=final.stat().st_size, key=key,
                             source_digest=inputs.digest, entries=dict(unit.spec.entries), compiler=tc.identity,
                             commands=key_cmds, inputs=dict(inputs.files), package_version=__version__)
            with file_lock(out / INDEX_LOCK, opts.timeout):
                index, problem = read_index(out)
                if problem and opts.log:
                    opts.log(f"warning: replacing {problem}")
                index[unit.slot] = new
                write_index(out, index)
            _prune(unit, out, keep=final.name)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return done("built", final)


# ----------------------------------------------------------------------------- entry point

def compile_kernels(targets: str | Iterable[str] = ("auto",), out_dir: str | Path | None = None,
                    only: str | Iterable[str] | None = None, archs: str | Iterable[str] | None = None,
                    force: bool = False, jobs: int | None = None, log: Log | None = None, *,
                    dry_run: bool = False, verbose: bool = False,
                    manifest: str | Path | Manifest | None = None) -> CompileReport:
    """Compile the manifest's kernels ahead of time (the CLI's `compile` is a thin layer over this).

    targets   'auto' (what this machine runs and its toolchains build; the rest lands in
              report.skipped), 'all' (what the toolchains build, for wheels and other hosts), or any
              of 'metal', 'cuda', 'cpu' (lists or comma strings)
    out_dir   default: MLX_AOT_CACHE_DIR, else registry/_artifacts when writable, else the user cache
    only      kernel names; archs: CUDA archs (sm_XX cubins, compute_XX PTX), replacing the manifest's
    jobs      parallel units (default: CPU count); log: receives progress lines
    Raises MissingToolchainError for an explicit target without its toolchain, ValueError for bad
    arguments, OSError for an unusable output dir; a failed unit is reported (status 'failed',
    message with the command, compiler output and sources), never raised."""
    start = time.monotonic()
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    arch_list = _split(archs)
    for a in arch_list:
        try:
            parse_cuda_arch(a)
        except ValueError as e:
            raise ValueError(f"archs: {e}") from None
    chosen, skipped = resolve_targets(targets, dry_run=dry_run)
    if log and "all" in _split(targets):
        log(f"--target all: every target the toolchains here build ({', '.join(chosen) or 'none'}), "
            f"not only what this machine runs, for wheels and other hosts")
    elif log and "auto" in _split(targets):
        log(f"--target auto: what this machine runs ({', '.join(chosen) or 'nothing buildable'}); "
            f"`--target all` builds every target the toolchains here build")
    for what, value in (("only", only), ("archs", archs)):
        items = [value] if isinstance(value, str) else list(value or ())
        if any(not _split(str(v)) for v in items):
            raise ValueError(f"{what}: an empty value; give names, or leave the option out")
    if arch_list and "cuda" not in chosen and "cuda" not in skipped:
        raise ValueError(f"archs: --arch sets CUDA archs, but no cuda target is built (targets: "
                         f"{', '.join(chosen) or 'none'}); add --target cuda or drop --arch")
    units, plan_skipped = plan(m, chosen, _split(only) or None, arch_list or None)
    skipped.update(plan_skipped)
    # absolute: the compiler commands run in the manifest's directory, so a relative --out would
    # name another directory there (the build's own outputs, then the dependency files, go missing)
    out = Path(out_dir).absolute() if out_dir is not None else default_output_dir()
    report = CompileReport(out_dir=str(out), targets=chosen, skipped=skipped)
    if not dry_run and units:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(f"output directory {out} is not writable; pass --out DIR or set MLX_AOT_CACHE_DIR")
        sweep_leftovers(out, log if verbose else None)
    opts = _Options(out, force, dry_run, verbose, log, lock_timeout())
    n, finished, counter = len(units), [0], threading.Lock()

    def one(unit: Unit) -> UnitResult:
        try:
            r = build_unit(unit, opts)
        except (BuildError, LockTimeoutError) as e:
            r = UnitResult(unit.spec.name, unit.target, unit.arch, "failed", message=str(e),
                           commands=[e.command] if getattr(e, "command", None) else [])
        if log:
            with counter:
                finished[0] += 1
                i = finished[0]
            log(f"[{i}/{n}] {r.label:<34} {r.status:<7} {r.seconds:6.2f}s" + (f"  {r.path}" if r.path and verbose else ""))
            if r.status == "failed":
                log(r.message)
            if dry_run:
                if r.message:
                    log(f"  {r.message}")
                for cmd in r.commands:
                    log(f"  $ {shlex.join(cmd)}")
        return r

    with ThreadPoolExecutor(max_workers=max(1, min(jobs or os.cpu_count() or 1, max(n, 1)))) as pool:
        report.results = list(pool.map(one, units))
    report.seconds = time.monotonic() - start
    return report


# ----------------------------------------------------------------------------- list / clean

@dataclass
class ArtifactState:
    kernel: str
    target: str
    arch: str | None
    state: str                 # fresh | stale | missing (as the registry would see it)
    path: str | None
    detail: str                # why stale/missing, with the fix

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.target}" + (f" {self.arch}" if self.arch else "")


def artifact_states(manifest: Manifest, dirs: list[Path], only: list[str] | None = None) -> list[ArtifactState]:
    """The state of every unit the manifest declares (cuda: its archs and ptx_arch) plus any other
    indexed arch, searched in `dirs` in order like the registry does. Needs no toolchain."""
    from registry.artifacts import fix_command

    units, _ = plan(manifest, list(TARGETS), _split(only) or None)
    indexes = [(d, read_index(d)) for d in dirs]
    names = {u.spec.name: u.spec for u in units}
    slots = dict.fromkeys(u.slot for u in units)   # ordered, deduplicated in linear time
    for _, (index, _) in indexes:
        slots.update(dict.fromkeys(s for s in index if s[0] in names and s[1] in names[s[0]].targets))
    inputs_cache: dict[tuple[str, str], object] = {}
    out = []
    for name, target, arch in slots:
        spec = names[name]
        if (name, target) not in inputs_cache:
            try:
                inputs_cache[name, target] = source_inputs(spec, target)
            except UnsafeFile as e:   # an #include of a FIFO or device: no artifact can be fresh
                inputs_cache[name, target] = e
        current = inputs_cache[name, target]
        unsafe = isinstance(current, UnsafeFile)
        why: list[str] = [str(current)] if unsafe else []
        state = None
        for d, (index, problem) in ([] if unsafe else indexes):
            if problem:
                why.append(problem)
                continue
            entry = index.get((name, target, arch))
            if entry is None:
                continue
            reason = check_entry(d, entry, current, spec)
            if reason is None:
                state = ArtifactState(name, target, arch, "fresh", str(d / entry.file), "")
                break
            why.append(reason)
        if state is None:
            fix = fix_command(spec, target) + (f" --arch {arch}" if arch else "")
            state = ArtifactState(name, target, arch, "stale" if why else "missing", None,
                                  "; ".join(why + [fix]))
        out.append(state)
    return out


def _inside(out: Path, p: Path) -> bool:
    """`p` is an entry directly or deeper inside `out`, reached without a symlink (so removing it
    removes nothing outside)."""
    try:
        rel = p.relative_to(out)
    except ValueError:
        return False
    cur = out
    for part in rel.parts:
        if part in ("", ".", ".."):
            return False
        cur = cur / part
        if cur.is_symlink():
            return False
    return True


def _remove_dir(out: Path, p: Path, removed: list[str], refused: list[str]) -> None:
    if not (p.exists() or p.is_symlink()):
        return
    if not _inside(out, p) or not p.is_dir():
        refused.append(f"{p} (a symlink, not a directory, or outside {out})")
        return
    shutil.rmtree(p)
    removed.append(str(p))


def clean_artifacts(out: Path, kernel_names: Iterable[str],
                    only: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Remove artifacts from `out`: the index (or the kernels' index entries) first, so nothing
    half-removed is ever loaded, then the kernels' folders and leftover temp dirs. (removed, refused).

    Only paths this pipeline creates are touched: folders named after kernels (identifiers: `only`
    must name kernels of the manifest; index names are checked identifiers), directly inside `out`
    and not symlinks; anything else is refused and named. Removal happens under the locks of the
    builds the paths belong to (lock files stay: deleting one that someone waits on would let two
    processes "hold" it)."""
    from contextlib import ExitStack

    from registry.artifacts import INDEX_NAME

    kernel_names = list(kernel_names)
    if only:
        unknown = [n for n in only if n not in kernel_names]
        if unknown:
            raise ValueError(f"only: unknown kernel(s) {', '.join(map(repr, unknown))}; declared: "
                             f"{', '.join(kernel_names) or '(none)'}")
    removed: list[str] = []
    refused: list[str] = []
    if not out.is_dir():
        return removed, refused
    timeout = lock_timeout()
    with file_lock(out / INDEX_LOCK, timeout):
        index, _ = read_index(out)   # its kernel names are checked identifiers
        names = list(only) if only else sorted({s[0] for s in index} | set(kernel_names))
        index_path = out / INDEX_NAME
        if index_path.is_symlink() or (index_path.exists() and not index_path.is_file()):
            refused.append(f"{index_path} (not a regular file)")
        elif only:
            if index_path.is_file():
                write_index(out, {s: e for s, e in index.items() if s[0] not in only})
        elif index_path.is_file():
            index_path.unlink()
            removed.append(str(index_path))
        for name in names:
            with ExitStack() as stack:
                for lock in sorted((out / UNIT_LOCKS).glob(f"{name}.*.lock")):
                    stack.enter_context(file_lock(lock, timeout))
                for p in [out / name, *out.glob(f"{TMP_PREFIX}{name}.*")]:
                    _remove_dir(out, p, removed, refused)
        if not only:
            for p in out.glob(".index.*.tmp"):
                if p.is_file() and not p.is_symlink():
                    p.unlink(missing_ok=True)
    return removed, refused


def sweep_leftovers(out: Path, log: Log | None = None) -> list[str]:
    """Temp dirs of killed builds of any unit (a `kill -9` during a --force rebuild leaves one even
    when the unit is fresh afterwards). A unit's temp dirs are only ever created under its lock, so
    those of a unit whose lock is free right now belong to dead builds."""
    swept = []
    for p in sorted(out.glob(f"{TMP_PREFIX}*")):
        tag = p.name[len(TMP_PREFIX):].rsplit("-", 1)[0]
        if not _TAG.match(tag) or p.is_symlink() or not p.is_dir():
            continue
        try:
            with file_lock(out / UNIT_LOCKS / f"{tag}.lock", 0):
                shutil.rmtree(p, ignore_errors=True)
        except LockTimeoutError:
            continue   # a live build's
        swept.append(str(p))
        if log:
            log(f"removed {p} (left by a killed build)")
    return swept
