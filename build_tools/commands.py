"""What gets built and the exact compiler commands: one build unit = (kernel, target, arch).

  metal  per source: xcrun -sdk macosx metal -std=<std> -O3 -mmacosx-version-min=<min> -I<dirs> <flags>
                     -MMD -MF <i>_<stem>.air.d -c <src> -o <i>_<stem>.air
         then:       xcrun -sdk macosx metallib <airs> -o <kernel>.metallib
  cuda   nvcc -cubin -arch=sm_XX (or -ptx -arch=compute_XX) -O3 -std=c++17 -I<dirs> <flags>
              -MD -MF <kernel>.d <src> -o <kernel>.cubin|.ptx
  cpu    per source: $CXX -std=c++17 -O3 -fPIC -fvisibility=hidden -I<dirs> <flags>
                     -MMD -MF <i>_<stem>.o.d -c <src> -o <i>_<stem>.o
         then:       $CXX -shared -fPIC <flags> <objects> -o <kernel>.so

Every step writes a dependency file; the driver checks it against the toolchain-free include scan
of registry/artifacts.py. Commands run with the manifest's directory as working directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from registry.artifacts import artifact_file
from registry.manifest import KernelSpec

from .toolchains import Toolchain

KINDS = {"cpu": "so", "metal": "metallib"}   # cuda: cubin or ptx, by arch


@dataclass(frozen=True)
class Unit:
    spec: KernelSpec
    target: str
    arch: str | None          # cuda only: sm_XX (cubin) or compute_XX (PTX)

    @property
    def kind(self) -> str:
        if self.target == "cuda":
            return "ptx" if self.arch.startswith("compute_") else "cubin"
        return KINDS[self.target]

    @property
    def slot(self) -> tuple[str, str, str | None]:
        return (self.spec.name, self.target, self.arch)

    @property
    def label(self) -> str:
        return f"{self.spec.name} {self.target}" + (f" {self.arch}" if self.arch else "")

    @property
    def tag(self) -> str:
        """File-name-safe unit name (kernel names are identifiers, so '.' separates unambiguously)."""
        return f"{self.spec.name}.{self.target}.{self.arch or 'any'}"

    @property
    def root(self) -> Path:
        return self.spec.root.resolve()

    def sources(self) -> list[Path]:
        return [p.resolve() for p in self.spec.source_paths(self.target)]

    def rel_dir(self) -> Path:
        return Path(self.spec.name) / self.target

    def file_name(self, key: str) -> str:
        return artifact_file(self.spec.name, self.target, self.arch, key).rsplit("/", 1)[1]

    def file_pattern(self) -> re.Pattern:
        """Any artifact file of this unit, whatever its key (to prune superseded and orphaned ones)."""
        arch = re.escape(f".{self.arch}") if self.arch else ""
        return re.compile(rf"^{re.escape(self.spec.name)}\.[0-9a-f]{{16}}{arch}\.{self.kind}$")


@dataclass(frozen=True)
class Recipe:
    commands: list[list[str]]
    output: Path                  # the artifact, inside the build dir
    depfiles: list[Path]          # make-style dependency files the commands write


def recipe(unit: Unit, build_dir: Path, tc: Toolchain) -> Recipe:
    """The exact argv list for one unit building into `build_dir`."""
    tspec = unit.spec.targets[unit.target]
    incs = [f"-I{p.resolve()}" for p in unit.spec.include_paths(unit.target)]
    flags = list(tspec.flags)
    sources = unit.sources()
    out = build_dir / f"{unit.spec.name}.{unit.kind}"
    if unit.target == "cuda":
        if len(sources) != 1:
            raise ValueError(f"cuda.sources must list exactly one translation unit (the launcher loads one module); "
                             f"got {len(sources)}: put shared code in headers")
        dep = build_dir / f"{unit.spec.name}.d"
        mode = "-ptx" if unit.kind == "ptx" else "-cubin"
        return Recipe([[*tc.command, mode, f"-arch={unit.arch}", "-O3", "-std=c++17", *incs, *flags,
                        "-MD", "-MF", str(dep), str(sources[0]), "-o", str(out)]], out, [dep])
    cmds, objs, deps = [], [], []
    for i, src in enumerate(sources):
        obj = build_dir / f"{i}_{src.stem}.{'air' if unit.target == 'metal' else 'o'}"
        dep = Path(f"{obj}.d")
        objs.append(str(obj))
        deps.append(dep)
        if unit.target == "metal":
            cmds.append([*tc.command, "metal", f"-std={tspec.std}", "-O3", f"-mmacosx-version-min={tspec.macos_min}",
                         *incs, *flags, "-MMD", "-MF", str(dep), "-c", str(src), "-o", str(obj)])
        else:
            cmds.append([*tc.command, "-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden", *incs, *flags,
                         "-MMD", "-MF", str(dep), "-c", str(src), "-o", str(obj)])
    if unit.target == "metal":
        cmds.append([*tc.command, "metallib", *objs, "-o", str(out)])
    else:
        cmds.append([*tc.command, "-shared", "-fPIC", *flags, *objs, "-o", str(out)])
    return Recipe(cmds, out, deps)


def key_commands(unit: Unit, tc: Toolchain) -> list[list[str]]:
    """The recipe as hashed into the build key: build dir -> <build>, manifest dir -> <root>, so a
    moved checkout or another temp dir keeps the key while any flag change alters it."""
    root = str(unit.root)
    build = Path("/<build>")
    r = recipe(unit, build, tc)

    def norm(arg: str) -> str:
        arg = arg.replace(str(build), "<build>")
        for prefix in ("", "-I"):
            if arg == prefix + root:
                return prefix + "<root>"
        return arg.replace(root + "/", "<root>/")
    return [[norm(a) for a in cmd] for cmd in r.commands]


def parse_depfile(path: Path, cwd: Path) -> list[Path]:
    """Prerequisites of a make-style dependency file (-MMD/-MD output), resolved against `cwd`."""
    text = path.read_text(encoding="utf-8", errors="replace").replace("\\\r\n", " ").replace("\\\n", " ")
    out: list[Path] = []
    for line in text.splitlines():
        # "target: prereq prereq"; targets may contain ':' only in Windows drive letters (not here).
        _, sep, rest = line.partition(": ")
        if not sep:
            continue
        for token in re.findall(r"(?:\\ |[^\s])+", rest):
            name = token.replace("\\ ", " ").replace("$$", "$")
            p = Path(name)
            out.append((p if p.is_absolute() else cwd / p).resolve())
    return out
