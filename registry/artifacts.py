"""Compiled artifacts on disk: where they live, how they are keyed, and the index that says which
file is current. Written by `python -m build_tools compile`, read by the registry at kernel-set
build time (never per kernel call).

Layout of an artifact directory:
    index.json                                   written last, atomically (the commit marker)
    <kernel>/<target>/<kernel>.<key16>.<ext>     content-keyed files: .so (cpu), .sm_90.cubin /
                                                 .compute_80.ptx (cuda), .metallib (metal)
    .lock                                        fcntl lock held by a compiling process

The registry loads a file only if its index entry's source_digest equals the digest of the current
manifest entry and sources (computed here, no toolchain needed) and the file's sha256 matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import envs
from ._version import __version__
from .manifest import KernelSpec
from .paths import PACKAGE_DIR

INDEX_NAME = "index.json"
INDEX_SCHEMA = 1
KEY_SCHEMA_VERSION = 1
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


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


def dependency_files(spec: KernelSpec, target: str) -> list[Path]:
    """Sources plus every header they include with #include "..." (recursively), resolved against
    the including file's directory, then the target's include dirs. <system> headers belong to the
    toolchain, whose identity is part of the build key."""
    include_dirs = spec.include_paths(target)
    seen: dict[Path, None] = {}
    stack = list(spec.source_paths(target))
    while stack:
        path = stack.pop(0).resolve()
        if path in seen or not path.is_file():
            continue
        seen[path] = None
        for name in _INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            for base in [path.parent, *include_dirs]:
                candidate = base / name
                if candidate.is_file():
                    stack.append(candidate)
                    break
    return list(seen)


def source_digest(spec: KernelSpec, target: str) -> str:
    """sha256 over everything that defines the kernel's code for `target`, toolchain excluded: the
    manifest fields that reach the binary (name, signature, entries, the target's block; not
    description, enable, requires or prefer, which change selection, not code), the bytes of every
    source and included header (keyed by path relative to the manifest), the package version and
    the key schema."""
    h = hashlib.sha256()
    entry = {k: spec.raw.get(k) for k in ("name", "signature", "entries", target)}
    h.update(json.dumps({"key_schema": KEY_SCHEMA_VERSION, "package": __version__, "target": target,
                         "entry": entry}, sort_keys=True, separators=(",", ":")).encode())
    root = spec.root.resolve()
    for path in dependency_files(spec, target):
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            rel = path.as_posix()
        h.update(b"\0" + rel.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def build_key(digest: str, compiler: str, flags: list[str], arch: str | None) -> str:
    """The full content key of one artifact: source digest + compiler identity + flags + arch."""
    payload = json.dumps({"source": digest, "compiler": compiler, "flags": flags, "arch": arch},
                         sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


# ----------------------------------------------------------------------------- index

@dataclass
class IndexEntry:
    kernel: str
    target: str
    arch: str | None
    file: str            # relative to the artifact dir
    sha256: str
    key: str
    source_digest: str
    entries: dict[str, str]
    compiler: str
    flags: list[str] = field(default_factory=list)

    @property
    def slot(self) -> tuple[str, str, str | None]:
        return (self.kernel, self.target, self.arch)


def read_index(directory: Path) -> tuple[dict[tuple, IndexEntry], str | None]:
    """(entries by (kernel, target, arch), problem) — a missing index is empty without a problem."""
    path = directory / INDEX_NAME
    if not path.is_file():
        return {}, None
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != INDEX_SCHEMA:
            return {}, f"{path}: index schema {data.get('schema')!r} is not {INDEX_SCHEMA}"
        entries = [IndexEntry(**e) for e in data["artifacts"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {}, f"{path}: unreadable index ({e})"
    return {e.slot: e for e in entries}, None


def write_index(directory: Path, entries: dict[tuple, IndexEntry]) -> None:
    """Atomically replace the index (temp file in the same directory + os.replace)."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"schema": INDEX_SCHEMA, "package_version": __version__,
               "artifacts": [e.__dict__ for e in sorted(entries.values(), key=lambda e: (e.kernel, e.target,
                                                                                        e.arch or ""))]}
    fd, tmp = tempfile.mkstemp(prefix=".index.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / INDEX_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- runtime lookup

@dataclass(frozen=True)
class Lookup:
    path: Path | None
    reason: str
    entries: dict[str, str] = field(default_factory=dict)


def _arch_number(arch: str) -> int:
    return int(re.sub(r"\D", "", arch.split("_", 1)[1]) or 0)


def _fix(spec: KernelSpec, target: str) -> str:
    return f"run: python -m build_tools compile --only {spec.name} --target {target}"


def check_entry(directory: Path, entry: IndexEntry, digest: str) -> str | None:
    """None if `entry` is loadable now, else why not."""
    path = directory / entry.file
    if entry.source_digest != digest:
        return f"{path} was built from other sources (stale)"
    if not path.is_file():
        return f"{path} is listed in {directory / INDEX_NAME} but missing"
    if sha256_file(path) != entry.sha256:
        return f"{path} does not match its sha256 in the index (corrupt or half-written)"
    return None


def lookup(spec: KernelSpec, target: str, *, arch: str | None = None) -> Lookup:
    """Find the artifact of `spec` for `target` (cuda: for device arch like 'sm_90': the exact cubin,
    else a PTX whose compute arch is not newer than the device). Never raises for artifact problems:
    the reason says what was tried and the command that fixes it."""
    if target not in spec.targets:
        return Lookup(None, f"kernel {spec.name!r} declares no {target} sources in {spec.root / 'kernels.yaml'}")
    digest = source_digest(spec, target)
    tried: list[str] = []
    for directory in artifact_dirs():
        index, problem = read_index(directory)
        if problem:
            tried.append(problem)
            continue
        candidates: list[IndexEntry] = []
        if target == "cuda":
            if arch is None:
                return Lookup(None, "cuda lookup needs the device arch (e.g. sm_90)")
            exact = index.get((spec.name, target, arch))
            if exact is not None:
                candidates.append(exact)
            ptx = [e for (k, t, a), e in index.items() if k == spec.name and t == target and a
                   and a.startswith("compute_") and _arch_number(a) <= _arch_number(arch)]
            candidates.extend(sorted(ptx, key=lambda e: -_arch_number(e.arch)))
        elif (spec.name, target, None) in index:
            candidates.append(index[(spec.name, target, None)])
        if not candidates:
            tried.append(f"{directory}: no {target}{' ' + arch if arch else ''} artifact")
            continue
        for entry in candidates:
            why = check_entry(directory, entry, digest)
            if why is None:
                note = f" (PTX {entry.arch}, JIT-compiled by the driver for {arch})" if (
                    target == "cuda" and entry.arch != arch) else ""
                return Lookup(directory / entry.file, f"loaded {directory / entry.file}{note}", dict(entry.entries))
            tried.append(why)
    return Lookup(None, f"no usable {target} artifact for {spec.name!r}: {'; '.join(tried)}; {_fix(spec, target)}")
