"""`python -m build_tools`: compile, list, validate, clean, doctor, selftest (and bench, from benchmarks/).

A thin layer over build_tools.compiler; importing this module is cheap (click only) so other
helpers can add subcommands: registry, MLX and the compilers load inside the commands that need them.
Exit codes: 0 ok; 1 a build failed, the manifest is invalid, or `clean` refused a path; 2 a bad
argument, an unusable output directory, or an explicitly requested target without its toolchain
(the message says the fix)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

MANIFEST_OPTION = click.option("--manifest", type=click.Path(dir_okay=False, path_type=Path), default=None,
                               help="Manifest to use (default: the checkout's or the packaged kernels.yaml).")


def _directory(ctx, param, value: str | None) -> Path | None:
    if value == "":   # Path("") is ".": an empty --out would silently mean the current directory
        raise click.BadParameter("an empty path; give a directory, or leave the option out")
    return None if value is None else Path(value)


OUT_OPTION = click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, callback=_directory,
                          help="Artifact directory (default: MLX_AOT_CACHE_DIR, else registry/_artifacts when "
                               "writable, else ~/.cache/mlx-aot-kernels/<version>).")


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _fail(msg: str, code: int) -> None:
    _err(f"error: {msg}")
    sys.exit(code)


def _load(manifest):
    from registry.errors import ManifestError
    from registry.manifest import load_manifest
    try:
        return load_manifest(manifest)
    except ManifestError as e:
        _err(str(e))
        _err(f"{len(e.problems)} problem(s); fix the manifest, then re-run `python -m build_tools validate`")
        sys.exit(1)


class LazyGroup(click.Group):
    """A click group whose `lazy` commands ("name" -> "module:attr") are imported only when listed
    or run, so `--help` and the other commands never pay for their imports."""

    lazy = {"bench": "benchmarks.cli:bench"}   # benchmarks/ ships with the source tree only

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *(n for n in self.lazy if self._load(n) is not None)})

    def get_command(self, ctx, name):
        return super().get_command(ctx, name) or self._load(name)

    def _load(self, name):
        if name not in self.lazy:
            return None
        import importlib
        module, attr = self.lazy[name].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name and module.split(".")[0] == e.name.split(".")[0]:
                return None   # not shipped in this install; a broken module still raises
            raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Ahead-of-time kernel builds for mlx-aot-kernels (docs/build.md)."""


@cli.command("env-table")
@click.option("--write", is_flag=True, help="Rewrite the table in docs/env-vars.md instead of checking it.")
@click.option("--file", "path", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="The markdown file holding the table (default: the checkout's docs/env-vars.md).")
@MANIFEST_OPTION
def env_table(write, path, manifest) -> None:
    """Check (or --write) docs/env-vars.md's table against registry/envs.py and kernels.yaml."""
    from registry import envs
    from registry.paths import PROJECT_ROOT

    m = _load(manifest)
    path = path or PROJECT_ROOT / "docs" / "env-vars.md"
    if not path.is_file():   # a FIFO or a device would block the read (or never end)
        _fail(f"--file {path}: not a regular file", 2)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--file {path}: cannot read it as UTF-8 text ({e})", 2)
    if envs.table_in(text) is None:
        _fail(f"{path}: the generated-table markers are missing ({envs.TABLE_BEGIN} ... {envs.TABLE_END})", 1)
    want = envs.render_table(m.kernels)
    if envs.table_in(text) == want:
        click.echo(f"{path}: table up to date ({want.count(chr(10)) - 1} variables)")
        return
    if not write:
        _fail(f"{path}: the table differs from registry/envs.py ENV_VARS and kernels.yaml's enable flags; "
              f"run `python -m build_tools env-table --write`", 1)
    head, rest = text.split(envs.TABLE_BEGIN, 1)
    path.write_text(head + envs.TABLE_BEGIN + "\n" + want + "\n" + envs.TABLE_END + rest.split(envs.TABLE_END, 1)[1])
    click.echo(f"{path}: table rewritten")


@cli.command()
@MANIFEST_OPTION
def validate(manifest) -> None:
    """Check kernels.yaml; print every problem (file:line: kernel: field: expected) and exit 1 if any."""
    m = _load(manifest)
    click.echo(f"{m.path}: OK ({len(m.kernels)} kernel(s): {', '.join(k.name for k in m.kernels)})")


@cli.command("compile")
@click.option("--target", "targets", multiple=True, default=("auto",), show_default=True, metavar="TARGET",
              help="auto|all|metal|cuda|cpu, repeatable or comma-separated. auto = what this machine runs "
                   "(the installed MLX's backends and devices; says what it skipped and why); all = every "
                   "target the toolchains here build (wheels, other hosts).")
@click.option("--only", multiple=True, metavar="NAME", help="Build only these kernels (repeatable or comma-separated).")
@click.option("--arch", "archs", multiple=True, metavar="LIST",
              help="CUDA archs, e.g. sm_90,compute_90 (sm_XX cubins, compute_XX PTX); replaces the manifest's "
                   "archs and ptx_arch.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel builds (default: CPU count).")
@OUT_OPTION
@click.option("--force", is_flag=True, help="Rebuild even when the artifact is fresh.")
@click.option("--dry-run", is_flag=True, help="Print the commands and what would be built; build nothing.")
@click.option("--verbose", "-v", is_flag=True, help="Stream each command and the compiler's output.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@MANIFEST_OPTION
def compile_cmd(targets, only, archs, jobs, out_dir, force, dry_run, verbose, as_json, manifest) -> None:
    """Compile every kernel of kernels.yaml ahead of time (progress on stderr)."""
    from registry.errors import EnvError

    from .compiler import MissingToolchainError, compile_kernels

    m = _load(manifest)

    def fail(msg: str) -> None:
        if as_json:
            click.echo(json.dumps({"ok": False, "error": msg}, indent=1))
        _fail(msg, 2)

    try:
        report = compile_kernels(targets=targets, out_dir=out_dir, only=only, archs=archs, force=force, jobs=jobs,
                                 log=_err, dry_run=dry_run, verbose=verbose, manifest=m)
    except MissingToolchainError as e:
        fail(f"{e}\n(`python -m build_tools doctor` checks every toolchain; `--target auto` builds what is here)")
    except (ValueError, EnvError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot use the output directory: {e}")
    for what, why in report.skipped.items():
        _err(f"skipped {what}: {why}")
    counts = report.counts()
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) if counts else "nothing to build"
    _err(f"{report.out_dir}: {summary} in {report.seconds:.2f}s")
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    sys.exit(0 if report.ok else 1)


@cli.command("list")
@OUT_OPTION
@click.option("--only", multiple=True, metavar="NAME", help="Only these kernels.")
@click.option("--json", "as_json", is_flag=True, help="Print the states as JSON.")
@MANIFEST_OPTION
def list_cmd(out_dir, only, as_json, manifest) -> None:
    """Kernels, their targets and each artifact's state as the registry sees it: fresh, stale or missing."""
    from dataclasses import asdict

    from registry.artifacts import artifact_dirs

    from .compiler import artifact_states

    m = _load(manifest)
    if any(not o.replace(",", " ").split() for o in only):
        _fail("--only: an empty value; give kernel names, or leave the option out", 2)
    dirs = [out_dir] if out_dir else artifact_dirs()
    try:
        states = artifact_states(m, dirs, list(only) or None)
    except ValueError as e:
        _fail(str(e), 2)
    if as_json:
        click.echo(json.dumps({"dirs": [str(d) for d in dirs], "artifacts": [asdict(s) for s in states]}, indent=1))
        return
    click.echo(f"artifact dirs (search order): {', '.join(str(d) for d in dirs)}")
    for spec in m.kernels:
        rows = [s for s in states if s.kernel == spec.name]
        if not rows:
            continue
        click.echo(f"{spec.name} (targets: {', '.join(spec.targets)}; enable: {spec.enable.env})")
        for s in rows:
            click.echo(f"  {s.target:<6} {s.arch or '':<12} {s.state:<8} {s.path or s.detail}")


@cli.command()
@OUT_OPTION
@click.option("--only", multiple=True, metavar="NAME", help="Remove only these kernels' artifacts.")
@MANIFEST_OPTION
def clean(out_dir, only, manifest) -> None:
    """Remove compiled artifacts (the index first, so nothing half-removed is ever loaded)."""
    from registry.artifacts import artifact_dirs

    from .compiler import clean_artifacts
    from .locking import LockTimeoutError

    names = [k.name for k in _load(manifest).kernels]
    if any(not o.replace(",", " ").split() for o in only):
        _fail("--only: an empty value; give kernel names, or leave the option out", 2)
    only = [n for o in only for n in o.replace(",", " ").split()]
    unknown = [n for n in only if n not in names]
    if unknown:
        _fail(f"--only: unknown kernel(s) {', '.join(map(repr, unknown))}; declared: {', '.join(names)}", 2)
    refused_any = False
    for d in ([out_dir] if out_dir else artifact_dirs()):
        try:
            removed, refused = clean_artifacts(d, names, only or None)
        except (LockTimeoutError, OSError, ValueError) as e:
            _fail(str(e), 1)
        for r in refused:
            _err(f"refused to remove {r}")
        refused_any = refused_any or bool(refused)
        click.echo(f"cleaned {d}: {len(removed)} path(s) removed" + (f" ({', '.join(only)})" if only else "")
                   + (f", {len(refused)} refused" if refused else ""))
    if refused_any:
        sys.exit(1)


@cli.command()
@MANIFEST_OPTION
def doctor(manifest) -> None:
    """Check the toolchains (xcrun metal/metallib, nvcc, the C++ compiler) and print the fix for each one missing."""
    from registry.artifacts import default_output_dir

    from . import toolchains

    from registry.errors import ManifestError
    from registry.manifest import load_manifest

    try:
        m = load_manifest(manifest)
    except ManifestError as e:
        m = None
        click.echo(f"[error]   manifest: {len(e.problems)} problem(s), first: {e.problems[0]}\n"
                   f"          fix it; `python -m build_tools validate` lists them all")
    missing = 0
    for target in ("metal", "cuda", "cpu"):
        tc = toolchains.find(target)
        if tc.available:
            click.echo(f"[ok]      {target:<6} {tc.detail}")
        else:
            missing += 1
            click.echo(f"[missing] {target:<6} {tc.detail}\n          fix: {tc.fix}")
        if target == "cuda" and tc.available and m is not None:
            _doctor_cuda_archs(m, toolchains)
    out = default_output_dir()
    click.echo(f"[info]    artifacts are written to {out}")
    runs = {t: toolchains.runs(t) for t in ("metal", "cuda", "cpu")}
    click.echo(f"[info]    `compile` (--target auto) builds what this machine runs: "
               f"{', '.join(t for t, why in runs.items() if not why)}"
               + "".join(f"; not {t}: {why}" for t, why in runs.items() if why))
    try:
        import mlx.core as mx
        click.echo(f"[info]    mlx {mx.__version__}, default device {mx.default_device()}, "
                   f"cuda={mx.cuda.is_available()}, metal={mx.metal.is_available()}")
    except ImportError as e:
        click.echo(f"[missing] mlx ({e})\n          fix: pip install 'mlx[cpu]==0.32.4' (Linux) or mlx==0.32.4 (macOS)")
    try:
        from registry import _ext  # noqa: F401
        click.echo("[ok]      native extension registry._ext imports")
    except ImportError as e:
        click.echo(f"[missing] native extension registry._ext ({e})\n          fix: pip install -e '.[cpu]' "
                   f"(Linux CUDA: pip install --no-build-isolation -e '.[cuda13]'; macOS: pip install -e .)")
    click.echo(f"{missing} toolchain(s) missing; `compile --target all` builds the rest" if missing
               else "all toolchains present")
    if m is None:
        sys.exit(1)   # a missing toolchain is normal (auto skips it); an unreadable manifest is not


@cli.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON to this file (attach it to a bug report).")
@OUT_OPTION
@MANIFEST_OPTION
def selftest(json_path, out_dir, manifest) -> None:
    """Compile for this machine's device, check every kernel against MLX's own ops and the drop-in
    cache against mlx-lm's own (tokens, decode speed); exit 1 if any check fails."""
    from . import selftest as st

    if json_path is not None and not json_path.parent.is_dir():
        _fail(f"--json {json_path}: the directory {json_path.parent} does not exist; give a file in an existing "
              f"directory", 2)
    m = _load(manifest)
    report = st.run(out_dir, m, log=_err)
    for line in st.summary(report):
        click.echo(line)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
        except OSError as e:
            _fail(f"--json {json_path}: cannot write the report ({e})", 2)
        click.echo(f"report written to {json_path}")
    sys.exit(0 if report["ok"] else 1)


def _doctor_cuda_archs(m, toolchains) -> None:
    supported, problem = toolchains.nvcc_archs()
    wanted = sorted({a for k in m.kernels if "cuda" in k.targets
                     for a in (*k.targets["cuda"].archs, k.targets["cuda"].ptx_arch) if a})
    unsupported = [a for a in wanted if supported and a not in supported]
    if problem:
        click.echo(f"[warn]    cuda   cannot list nvcc's archs: {problem}")
    elif unsupported:
        click.echo(f"[warn]    cuda   this nvcc cannot build {', '.join(unsupported)} (kernels.yaml asks for "
                   f"them)\n          fix: {toolchains.NVCC_FIX}")
    else:
        click.echo(f"[ok]      cuda   nvcc builds every arch kernels.yaml asks for ({', '.join(wanted)})")
