"""`python -m build_tools`: compile, list, validate, clean, doctor (and bench, from benchmarks/)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import click

MANIFEST_OPTION = click.option("--manifest", type=click.Path(dir_okay=False, path_type=Path), default=None,
                               help="Manifest to use (default: the packaged kernels.yaml).")
OUT_OPTION = click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                          help="Artifact directory (default: MLX_AOT_CACHE_DIR, else registry/_artifacts when "
                               "writable, else the user cache).")


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _load(manifest):
    from registry.errors import ManifestError
    from registry.manifest import load_manifest
    try:
        return load_manifest(manifest)
    except ManifestError as e:
        _err(str(e))
        _err(f"{len(e.problems)} problem(s); fix the manifest, then re-run `python -m build_tools validate`")
        sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Ahead-of-time kernel builds for mlx-aot-kernels (docs/build.md)."""


@cli.command()
@MANIFEST_OPTION
def validate(manifest) -> None:
    """Check kernels.yaml; print every problem (file:line: kernel: field: expected) and exit 1 if any."""
    m = _load(manifest)
    click.echo(f"{m.path}: OK ({len(m.kernels)} kernel(s): {', '.join(k.name for k in m.kernels)})")


@cli.command("compile")
@click.option("--target", "targets", multiple=True, default=("auto",), show_default=True,
              type=click.Choice(["auto", "all", "metal", "cuda", "cpu"]),
              help="What to build; auto = every target this machine's toolchains can build. Repeatable.")
@click.option("--only", multiple=True, help="Build only this kernel (repeatable).")
@click.option("--arch", "arch", default=None, help="Comma-separated CUDA archs (sm_90,compute_90); default: the manifest's.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel builds (default: CPU count).")
@OUT_OPTION
@click.option("--force", is_flag=True, help="Rebuild even when the artifact is fresh.")
@click.option("--dry-run", is_flag=True, help="Print the commands; build nothing.")
@click.option("--verbose", "-v", is_flag=True, help="Stream commands and compiler output.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@MANIFEST_OPTION
def compile_cmd(targets, only, arch, jobs, out_dir, force, dry_run, verbose, as_json, manifest) -> None:
    """Compile every kernel of kernels.yaml ahead of time."""
    from .compiler import MissingToolchainError, compile_kernels

    m = _load(manifest)
    start = time.monotonic()
    archs = [a.strip() for a in arch.split(",") if a.strip()] if arch else None
    try:
        report = compile_kernels(targets=targets, out_dir=out_dir, only=list(only) or None, archs=archs,
                                 force=force, jobs=jobs, dry_run=dry_run, verbose=verbose, log=_err, manifest=m)
    except MissingToolchainError as e:
        _err(f"error: {e}")
        sys.exit(2)
    except ValueError as e:
        _err(f"error: {e}")
        sys.exit(2)
    for what, why in report.skipped.items():
        _err(f"skipped {what}: {why}")
    counts = {s: sum(r.status == s for r in report.results) for s in ("built", "fresh", "failed", "planned")}
    _err(f"{report.out_dir}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
         + f" in {time.monotonic() - start:.2f}s" if report.results else f"{report.out_dir}: nothing to build")
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    sys.exit(0 if report.ok else 1)


@cli.command("list")
@OUT_OPTION
@MANIFEST_OPTION
def list_cmd(out_dir, manifest) -> None:
    """Kernels, their targets and the state of each artifact: missing, fresh or stale."""
    from registry.artifacts import artifact_dirs, check_entry, read_index, source_digest

    m = _load(manifest)
    dirs = [out_dir] if out_dir else artifact_dirs()
    indexes = [(d, read_index(d)[0]) for d in dirs]
    for spec in m.kernels:
        click.echo(f"{spec.name} (kernel_attr={spec.kernel_attr}, enable={spec.enable.env})")
        for target in spec.targets:
            digest = source_digest(spec, target)
            rows = [(d, e) for d, idx in indexes for (k, t, _), e in idx.items() if k == spec.name and t == target]
            if not rows:
                click.echo(f"  {target:<6} {'':<12} missing   (python -m build_tools compile --only {spec.name} "
                           f"--target {target})")
            for d, e in sorted(rows, key=lambda r: r[1].arch or ""):
                why = check_entry(d, e, digest)
                click.echo(f"  {target:<6} {e.arch or '':<12} {'fresh' if why is None else 'stale':<9} "
                           f"{d / e.file}" + (f"  ({why})" if why else ""))


@cli.command()
@OUT_OPTION
@click.option("--only", multiple=True, help="Remove only this kernel's artifacts (repeatable).")
def clean(out_dir, only) -> None:
    """Remove compiled artifacts (the index first, so nothing half-removed is ever loaded)."""
    from registry.artifacts import INDEX_NAME, artifact_dirs, read_index, write_index

    from .compiler import file_lock
    for d in ([out_dir] if out_dir else artifact_dirs()):
        if not d.exists():
            continue
        with file_lock(d / ".lock"):
            if only:
                index, _ = read_index(d)
                write_index(d, {s: e for s, e in index.items() if s[0] not in only})
                for name in only:
                    shutil.rmtree(d / name, ignore_errors=True)
            else:
                (d / INDEX_NAME).unlink(missing_ok=True)
                for child in d.iterdir():
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
        click.echo(f"cleaned {d}" + (f" ({', '.join(only)})" if only else ""))


@cli.command()
def doctor() -> None:
    """Check the toolchains and print the fix for each one missing."""
    from . import toolchains
    missing = 0
    for target in ("metal", "cuda", "cpu"):
        tc = toolchains.find(target)
        if tc.available:
            click.echo(f"[ok]      {target:<6} {tc.detail}")
        else:
            missing += 1
            click.echo(f"[missing] {target:<6} {tc.detail}\n          fix: {tc.fix}")
    import mlx.core as mx
    click.echo(f"[info]    mlx {mx.__version__}, default device {mx.default_device()}, "
               f"cuda={mx.cuda.is_available()}, metal={mx.metal.is_available()}")
    try:
        from registry import _ext  # noqa: F401
        click.echo("[ok]      native extension registry._ext imports")
    except ImportError as e:
        click.echo(f"[missing] native extension registry._ext ({e})\n          fix: pip install -e '.[cpu]' "
                   f"(Linux CUDA: pip install --no-build-isolation -e '.[cuda13]')")
    click.echo(f"{missing} toolchain(s) missing; `compile --target auto` builds the rest" if missing
               else "all toolchains present")


def _register_bench() -> None:
    try:
        from benchmarks.cli import bench
    except ImportError:  # benchmarks/ ships with the source tree, not with every install
        return
    cli.add_command(bench)


_register_bench()
