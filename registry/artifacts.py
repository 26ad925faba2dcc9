"""Compiled artifacts on disk: where they live, how they are keyed, and the index that says which
file is current. Written by `python -m build_tools compile`, read by the registry once per kernel-set
build (never per kernel call). docs/build.md describes the layout, keys and failure modes.

Layout of an artifact directory:
    index.json                                      written last, atomically (the commit marker)
    <kernel>/<target>/<kernel>.<key16>[.<arch>].<ext>  content-keyed files: .so (cpu), .sm_90.cubin /
                                                    .compute_80.ptx (cuda), .metallib (metal)
    .lock, .locks/                                  fcntl locks of compiling processes
    .tmp-*/                                         private build dirs (leftovers of killed builds)

Two digests, both sha256 over canonical JSON (never Python's hash()):
  source_digest  manifest entry + every source and included header + package version + schema.
                 Needs no toolchain: the registry recomputes it at run time and refuses a mismatch.
  key            source_digest + compiler identity + the exact (path-normalised) commands + arch.
                 `compile` skips a unit whose index entry carries the same key and an intact file.

The index is input like any other: every field is type-checked, and the kernel name, file path and
entry symbols come from kernels.yaml (the index only has to agree). An artifact is read once, as a
regular file below the artifact directory reached without following a symlink and of bounded size;
its size, sha256 and entry symbols are checked on those bytes, and the launcher loads those bytes
(registry/native.py), never the file again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from . import envs
from ._version import __version__
from .manifest import TARGETS, KernelSpec
from .paths import PACKAGE_DIR
from .symbols import cubin_sm, missing_entries

INDEX_NAME = "index.json"
INDEX_SCHEMA = 3
MAX_INDEX_BYTES = 16 * 1024 * 1024
MAX_ARTIFACT_BYTES = 512 * 1024 * 1024
_KERNEL_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,63}\Z")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
KEY_SCHEMA_VERSION = 2
# `#include "x"` and `#include <x>`; angle includes count only when they resolve inside the
# kernel's include_dirs (anything else belongs to the toolchain, whose identity is in the key).
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^">\n]+)[">]', re.M)
_CUDA_ARCH = re.compile(r"^(sm|compute)_([0-9]{2,3})([af]?)\Z")
# The pseudo-input naming the kernel's manifest entry in `inputs` (a real path never starts with "<").
MANIFEST_INPUT = "<kernels.yaml entry>"


# ----------------------------------------------------------------------------- locations

def package_artifact_dir() -> Path:
    return PACKAGE_DIR / "_artifacts"


def user_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mlx-aot-kernels" / __version__


def artifact_dirs() -> list[Path]:
    """Search order: MLX_AOT_CACHE_DIR alone when set; else the in-package directory, then the user cache."""
    override = envs.get_path("MLX_AOT_CACHE_DIR")
    if override is not None:
        return [override]
    return [package_artifact_dir(), user_cache_dir()]


def default_output_dir() -> Path:
    """Where `compile` writes: MLX_AOT_CACHE_DIR, else the package directory when writable
    (source checkouts, editable installs, wheel builds), else the user cache."""
    override = envs.get_path("MLX_AOT_CACHE_DIR")
    if override is not None:
        return override
    pkg = package_artifact_dir()
    probe = pkg if pkg.exists() else pkg.parent
    return pkg if os.access(probe, os.W_OK) else user_cache_dir()


# ----------------------------------------------------------------------------- digests

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def artifact_file(name: str, target: str, arch: str | None, key: str) -> str:
    """The artifact's path relative to the artifact directory, derived from kernels.yaml's name, the
    target, the arch and the build key (never taken from the index)."""
    kind = ("ptx" if arch.startswith("compute_") else "cubin") if target == "cuda" else (
        {"cpu": "so", "metal": "metallib"}[target])
    return f"{name}/{target}/{name}.{key[:16]}{'.' + arch if arch else ''}.{kind}"


def artifact_kind(target: str, arch: str | None) -> str:
    return artifact_file("k", target, arch, "0" * 16).rsplit(".", 1)[1]


class UnsafeFile(OSError):
    """A file the artifact directory may not hand out: a symlink, not a regular file, too large."""


def read_confined(directory: Path, rel: str, limit: int) -> bytes:
    """The bytes of `directory/rel`: every component below `directory` opened without following a
    symlink, the last one a regular file (a FIFO or device is refused, without blocking) of at most
    `limit` bytes. `rel` must be relative without '..'. Raises FileNotFoundError or UnsafeFile/OSError."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in rel:
        raise UnsafeFile(f"{rel!r} is not a plain relative path inside {directory}")
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    cloexec = getattr(os, "O_CLOEXEC", 0)
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | cloexec)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow | cloexec, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFile(f"{directory / rel}: {part} is a symlink or not a directory") from None
                raise
            os.close(fd)
            fd = nxt
        try:
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | nofollow | cloexec, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeFile(f"{directory / rel} is a symlink") from None
            raise
    finally:
        os.close(fd)
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{directory / rel} is not a regular file")
        if st.st_size > limit:
            raise UnsafeFile(f"{directory / rel} is {st.st_size} bytes; the limit is {limit}")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(ffd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise UnsafeFile(f"{directory / rel} grew past {limit} bytes while being read")
        return b"".join(chunks)
    finally:
        os.close(ffd)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def dependency_files(spec: KernelSpec, target: str) -> list[Path]:
    """The target's sources plus every header they include, recursively (resolved paths, sources
    first). `#include "x"` is looked up next to the including file, then in the include dirs;
    `#include <x>` in the include dirs only. The build cross-checks this scan against the
    compiler's own dependency output (build_tools/compiler.py), so a header reached another way
    (a computed #include) fails the build instead of silently missing from the key."""
    include_dirs = [p.resolve() for p in spec.include_paths(target)]
    seen: dict[Path, None] = {}
    queue = [p.resolve() for p in spec.source_paths(target)]
    while queue:
        path = queue.pop(0)
        if path in seen or not path.is_file():
            continue
        seen[path] = None
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in _INCLUDE.finditer(text):
            quote, name = m.groups()
            bases = ([path.parent] if quote == '"' else []) + include_dirs
            for base in bases:
                candidate = (base / name).resolve()
                if candidate.is_file():
                    queue.append(candidate)
                    break
                if candidate.exists():   # a FIFO or a device: the compiler would block on it or read it forever
                    line = text.count("\n", 0, m.start()) + 1
                    spelled = f'"{name}"' if quote == '"' else f"<{name}>"
                    raise UnsafeFile(f"{path}:{line}: #include {spelled} resolves to {candidate}, which is not a "
                                     f"regular file; include a regular header")
    return list(seen)


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


@dataclass(frozen=True)
class SourceInputs:
    """Everything that defines a kernel's code for one target, toolchain excluded."""
    target: str
    files: dict[str, str]          # input name -> sha256: the manifest entry and each source/header

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canonical({"key_schema": KEY_SCHEMA_VERSION, "package": __version__,
                                          "target": self.target, "inputs": self.files})).hexdigest()


def source_inputs(spec: KernelSpec, target: str) -> SourceInputs:
    """The manifest fields that reach the binary (name, signature, entries, the target's block; not
    description, enable, requires or prefer, which change selection, not code) and the sha256 of
    every source and included header, keyed by path relative to the manifest's directory (so a
    moved checkout keeps its artifacts)."""
    entry = {k: spec.raw.get(k) for k in ("name", "signature", "entries", target)}
    files = {MANIFEST_INPUT: hashlib.sha256(_canonical(entry)).hexdigest()}
    root = spec.root.resolve()
    for path in dependency_files(spec, target):
        files[_rel(path, root)] = sha256_file(path)
    return SourceInputs(target, files)


def source_digest(spec: KernelSpec, target: str) -> str:
    return source_inputs(spec, target).digest


def build_key(digest: str, compiler: str, commands: list[list[str]], arch: str | None) -> str:
    """The content key of one artifact: source digest + compiler identity + the exact commands
    (paths normalised, so every fixed flag, include dir and yaml flag counts) + arch."""
    return hashlib.sha256(_canonical({"source": digest, "compiler": compiler, "commands": commands,
                                      "arch": arch})).hexdigest()


# ----------------------------------------------------------------------------- index

@dataclass
class IndexEntry:
    kernel: str
    target: str
    arch: str | None
    file: str                  # relative to the artifact dir (must equal artifact_file(...))
    sha256: str                # of the file
    size: int                  # of the file, in bytes
    key: str                   # build key (toolchain included)
    source_digest: str         # toolchain-free digest the registry recomputes
    entries: dict[str, str]    # dtype -> entry symbol, checked present in the file
    compiler: str
    commands: list[list[str]]  # as hashed into the key (paths normalised)
    inputs: dict[str, str]     # what source_digest covered: name -> sha256 (explains staleness)
    package_version: str

    @property
    def slot(self) -> tuple[str, str, str | None]:
        return (self.kernel, self.target, self.arch)


_ENTRY_FIELDS = {f.name for f in fields(IndexEntry)}


def _str_map(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


# Field -> (check, what it must be). Only the shape is checked here; agreement with kernels.yaml
# (file path, entries, kernel) is checked where an entry is used (check_entry).
_FIELD_CHECKS = {
    "kernel": (lambda v: isinstance(v, str) and bool(_KERNEL_NAME.match(v)), "a kernel name"),
    "target": (lambda v: v in TARGETS, f"one of {', '.join(TARGETS)}"),
    "arch": (lambda v: v is None or (isinstance(v, str) and bool(_CUDA_ARCH.match(v))),
             "null or a CUDA arch like sm_90"),
    "file": (lambda v: isinstance(v, str) and len(v) < 1024, "a relative path string"),
    "sha256": (lambda v: isinstance(v, str) and bool(_HEX64.match(v)), "64 hex digits"),
    "size": (lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    "key": (lambda v: isinstance(v, str) and bool(_HEX64.match(v)), "64 hex digits"),
    "source_digest": (lambda v: isinstance(v, str) and bool(_HEX64.match(v)), "64 hex digits"),
    "entries": (_str_map, "a mapping dtype -> symbol"),
    "compiler": (lambda v: isinstance(v, str), "a string"),
    "commands": (lambda v: isinstance(v, list) and all(isinstance(c, list) and all(isinstance(a, str) for a in c)
                                                        for c in v), "a list of argument lists"),
    "inputs": (_str_map, "a mapping name -> sha256"),
    "package_version": (lambda v: isinstance(v, str), "a string"),
}
assert set(_FIELD_CHECKS) == _ENTRY_FIELDS


def _short(value) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else f"{type(value).__name__} of {len(value)}"
    return text if len(text) <= 60 else text[:60] + "..."


def read_index(directory: Path) -> tuple[dict[tuple, IndexEntry], str | None]:
    """(entries by (kernel, target, arch), problem); a missing index is empty without a problem.
    A symlinked, non-regular or oversized index, or any field of the wrong type, makes the whole
    index unusable, with the reason (the registry falls back; the next `compile` replaces it)."""
    path = Path(directory) / INDEX_NAME
    try:
        raw_bytes = read_confined(Path(directory), INDEX_NAME, MAX_INDEX_BYTES)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"{path}: unreadable index ({e})"
    try:
        data = json.loads(raw_bytes.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        return {}, f"{path}: unreadable index (not JSON: {_short(str(e))})"
    if not isinstance(data, dict) or data.get("schema") != INDEX_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else None
        return {}, f"{path}: index schema {_short(got)} is not {INDEX_SCHEMA} (written by another version)"
    artifacts = data.get("artifacts")
    if not isinstance(artifacts, list):
        return {}, f"{path}: unreadable index (artifacts: expected a list, got {type(artifacts).__name__})"
    entries: dict[tuple, IndexEntry] = {}
    for i, raw in enumerate(artifacts):
        if not isinstance(raw, dict) or set(raw) != _ENTRY_FIELDS:
            got = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
            return {}, (f"{path}: unreadable index (artifacts[{i}]: fields {_short(got)} are not "
                        f"{sorted(_ENTRY_FIELDS)})")
        for name, (ok, what) in _FIELD_CHECKS.items():
            if not ok(raw[name]):
                return {}, (f"{path}: unreadable index (artifacts[{i}].{name}: expected {what}, got "
                            f"{type(raw[name]).__name__} {_short(raw[name])})")
        entry = IndexEntry(**raw)
        if (entry.target == "cuda") != (entry.arch is not None):
            return {}, (f"{path}: unreadable index (artifacts[{i}].arch: {_short(entry.arch)} for target "
                        f"{entry.target}; only cuda artifacts have an arch, and every one has)")
        if entry.slot in entries:
            return {}, f"{path}: unreadable index (artifacts[{i}]: a second entry for {entry.slot})"
        entries[entry.slot] = entry
    return entries, None


def write_index(directory: Path, entries: dict[tuple, IndexEntry]) -> None:
    """Atomically replace the index: temp file in the same directory, fsync, os.replace."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"schema": INDEX_SCHEMA, "package_version": __version__,
               "artifacts": [asdict(e) for e in sorted(entries.values(),
                                                       key=lambda e: (e.kernel, e.target, e.arch or ""))]}
    fd, tmp = tempfile.mkstemp(prefix=".index.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / INDEX_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


# ----------------------------------------------------------------------------- checks

def why_stale(entry: IndexEntry, current: SourceInputs) -> str:
    """Which inputs differ between the build recorded in `entry` and the sources now."""
    if entry.package_version != __version__:
        return f"built by mlx-aot-kernels {entry.package_version}, this is {__version__}"
    old, new = entry.inputs, current.files
    parts = []
    if old.get(MANIFEST_INPUT) != new.get(MANIFEST_INPUT):
        parts.append(f"its kernels.yaml entry ({entry.kernel}: signature/entries/{entry.target}) changed")
    changed = sorted(k for k in old.keys() & new.keys() if k != MANIFEST_INPUT and old[k] != new[k])
    added = sorted(new.keys() - old.keys())
    removed = sorted(old.keys() - new.keys())
    if changed:
        parts.append("changed: " + ", ".join(changed))
    if added:
        parts.append("now also includes: " + ", ".join(added))
    if removed:
        parts.append("no longer includes: " + ", ".join(removed))
    return "; ".join(parts) or "built with another key schema"


def verify_entry(directory: Path, entry: IndexEntry, current: SourceInputs,
                 spec: KernelSpec) -> tuple[str | None, bytes | None]:
    """(None, the artifact's verified bytes) if `entry` is loadable now for `spec`, else (why not,
    None). Name, path and entry symbols come from kernels.yaml; the index has to agree with them."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if (entry.kernel, entry.target) != (spec.name, current.target):
        return f"{index}: entry for {entry.kernel} {entry.target} used for {spec.name} {current.target}", None
    want = artifact_file(spec.name, entry.target, entry.arch, entry.key)
    path = directory / want
    if entry.file != want:
        return (f"{index}: the file of {spec.name} {entry.target}{' ' + entry.arch if entry.arch else ''} is "
                f"{_short(entry.file)}, not {want} (refused: artifacts are found by kernels.yaml's names)"), None
    if entry.source_digest != current.digest:
        return f"{path} is stale ({why_stale(entry, current)})", None
    if entry.entries != spec.entries:
        diff = [f"{dt}: {_short(entry.entries.get(dt))} in the index, {_short(spec.entries.get(dt))} in kernels.yaml"
                for dt in sorted(set(entry.entries) | set(spec.entries), key=str)
                if entry.entries.get(dt) != spec.entries.get(dt)]
        return (f"{path}: the index's entries differ from kernels.yaml ({'; '.join(diff[:3])}) (refused: an "
                f"entry symbol of another dtype would run with the wrong element size)"), None
    try:
        data = read_confined(directory, want, MAX_ARTIFACT_BYTES)
    except FileNotFoundError:
        return f"{path} is listed in {index} but missing", None
    except OSError as e:
        return f"{path}: refused ({e})", None
    if len(data) != entry.size:
        return f"{path} is {len(data)} bytes, the index says {entry.size} (corrupt or half-written)", None
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        return f"{path} does not match its sha256 in the index (corrupt or half-written)", None
    kind = artifact_kind(entry.target, entry.arch)
    try:
        missing = missing_entries(data, kind, list(spec.entries.values()))
        sm = cubin_sm(data) if kind == "cubin" else None
    except ValueError as e:
        return f"{path}: refused ({e})", None
    if missing:
        return f"{path}: refused: entry symbol(s) {', '.join(missing)} of kernels.yaml are not in it", None
    if sm is not None and sm != parse_cuda_arch(entry.arch)[1]:
        return f"{path}: refused: the cubin targets sm_{sm}, not {entry.arch}", None
    return None, data


def check_entry(directory: Path, entry: IndexEntry, current: SourceInputs, spec: KernelSpec) -> str | None:
    """None if `entry` is loadable now, else why not (names the file)."""
    return verify_entry(directory, entry, current, spec)[0]


# ----------------------------------------------------------------------------- runtime lookup

@dataclass(frozen=True)
class Lookup:
    path: Path | None          # the artifact to load, or None
    reason: str                # why it was chosen, or why nothing is usable and the fix command
    entries: dict[str, str] = field(default_factory=dict)   # dtype -> entry symbol (kernels.yaml's)
    data: bytes | None = field(default=None, repr=False)    # the verified bytes: what the launcher loads


def parse_cuda_arch(arch: str) -> tuple[str, int, str]:
    """'sm_90a' -> ('sm', 90, 'a'); ValueError naming the expected form otherwise."""
    m = _CUDA_ARCH.match(arch or "")
    if not m:
        raise ValueError(f"{arch!r} is not a CUDA arch like sm_90 or compute_80")
    return m.group(1), int(m.group(2)), m.group(3)


def fix_command(spec: KernelSpec, target: str, arch: str | None = None) -> str:
    cmd = f"python -m build_tools compile --only {spec.name} --target {target}"
    tspec = spec.targets.get(target)
    if target == "cuda" and arch and tspec is not None and arch not in tspec.archs:
        cmd += f" --arch {arch}"   # the manifest's default list does not cover this device
    return f"run: {cmd}"


def _cuda_candidates(index: dict, name: str, arch: str) -> list[IndexEntry]:
    """The exact cubin, then PTX whose compute arch the device can JIT (newest first). Arch-specific
    PTX (compute_90a) only serves the identical device arch."""
    _, dev, dev_suffix = parse_cuda_arch(arch)
    out = [index[(name, "cuda", arch)]] if (name, "cuda", arch) in index else []
    ptx = []
    for (k, t, a), e in index.items():
        if k != name or t != "cuda" or not a or not a.startswith("compute_"):
            continue
        _, num, suffix = parse_cuda_arch(a)
        if num <= dev and (not suffix or (num == dev and suffix == dev_suffix)):
            ptx.append((num, e))
    out.extend(e for _, e in sorted(ptx, key=lambda p: -p[0]))
    return out


def lookup(spec: KernelSpec, target: str, *, arch: str | None = None) -> Lookup:
    """The artifact of `spec` for `target` (cuda: `arch` is the device's, like 'sm_90': the exact
    cubin, else a PTX whose compute arch is not newer than the device). Reads each index once,
    hashes the sources once and the chosen file once; never raises for artifact problems: the
    reason says what was tried and the command that fixes it."""
    if target not in spec.targets:
        return Lookup(None, f"kernel {spec.name!r} declares no {target} sources in {spec.root / 'kernels.yaml'}")
    if target == "cuda":
        try:
            if arch is None or parse_cuda_arch(arch)[0] != "sm":
                raise ValueError(f"{arch!r} is not a device arch like sm_90")
        except ValueError as e:
            return Lookup(None, f"cuda lookup needs the device arch: {e}")
    elif arch is not None:
        return Lookup(None, f"{target} artifacts have no arch; got arch={arch!r}")
    try:
        current = source_inputs(spec, target)
    except UnsafeFile as e:
        return Lookup(None, f"kernel {spec.name!r}: {e}")
    tried: list[str] = []
    for directory in artifact_dirs():
        index, problem = read_index(directory)
        if problem:
            tried.append(problem)
            continue
        if target == "cuda":
            candidates = _cuda_candidates(index, spec.name, arch)
        else:
            candidates = [index[(spec.name, target, None)]] if (spec.name, target, None) in index else []
        if not candidates:
            tried.append(f"{directory}: no {target}{' ' + arch if arch else ''} artifact"
                         + ("" if (directory / INDEX_NAME).is_file() else " (no index.json)"))
            continue
        for entry in candidates:
            why, data = verify_entry(directory, entry, current, spec)
            if why is None:
                path = directory / entry.file
                note = f" (PTX {entry.arch}, JIT-compiled by the driver for {arch})" if (
                    target == "cuda" and entry.arch != arch) else ""
                return Lookup(path, f"loaded {path}{note}", dict(spec.entries), data)
            tried.append(why)
    return Lookup(None, f"no usable {target}{' ' + arch if arch else ''} artifact for {spec.name!r}: "
                        f"{'; '.join(tried)}; {fix_command(spec, target, arch)}")
