"""The one module that reads environment variables. Each variable is declared once in ENV_VARS
(name, type, default, where it is read, what it does); the table of docs/env-vars.md is generated
from it and from kernels.yaml's enable flags (`render_table`; `python -m build_tools env-table
--write` rewrites it, tests/test_envs.py checks it). Per-kernel enable flags are declared in
kernels.yaml (`enable.env`) and parsed with `parse_flag` below, so they follow the same rules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import EnvError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # "flag" | "path" | "float" | "level" | "list"
    default: str | None
    read_in: str
    doc: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("MLX_AOT_CACHE_DIR", "path", None, "registry/artifacts.py",
           "Directory holding compiled artifacts; replaces both the in-package and the user cache "
           "directory for `compile` and for the registry."),
    EnvVar("MLX_AOT_LOCK_TIMEOUT", "float", "600", "build_tools/compiler.py",
           "Seconds `compile` waits for another process's build lock before failing with the lock path."),
    EnvVar("MLX_AOT_LOG_LEVEL", "level", None, "registry/__init__.py",
           "Log level of the `registry` logger (`DEBUG` shows every rejection reason)."),
    EnvVar("MLX_AOT_DISABLE_NATIVE", "flag", "0", "registry/native.py",
           "Never load native artifacts; every kernel runs its reference path (for A/B checks)."),
    EnvVar("MLX_AOT_REQUIRE_NATIVE", "flag", "0", "registry/native.py",
           "Raise instead of falling back when a selected kernel's artifact is missing or stale."),
    EnvVar("MLX_AOT_HOOK_MODULES", "list", None, "registry/manifest.py",
           "Comma-separated module names, outside the `registry` package, that kernels.yaml may name "
           "as `wrapper`/`check` (e.g. tests.toy_wrapper); unset: only registry.* modules."),
    EnvVar("MLX_AOT_DIRECT_ATTENTION", "flag", "1",
           "registry/integrations/mlx_lm_cache.py, registry/integrations/slot_engine.py",
           "The drop-in cache and the slot engine run the fused layers whose attention is the llama form "
           "through its direct forward (registry/integrations/direct_attention.py); `0`: every fused layer "
           "goes through the rope capture (for A/B checks). Read by each make_prompt_cache call and each "
           "SlotEngine without `direct=`."),
    EnvVar("MLX_AOT_PACK_QKV", "flag", "1", "registry/integrations/mlx_lm_cache.py",
           "The drop-in cache's direct forward runs a decode step's q/k/v projections as one projection of "
           "the packed rows (registry/integrations/direct_attention.py, `pack_qkv`; the modules keep views "
           "of them); `0`: three projections, as stock (for A/B checks). Read by each make_prompt_cache call."),
)
_BY_NAME = {v.name: v for v in ENV_VARS}
_KIND_LABEL = {"flag": "flag", "path": "path", "float": "seconds", "level": "level", "list": "list"}
TABLE_BEGIN = "<!-- generated from registry/envs.py and kernels.yaml: python -m build_tools env-table --write -->"
TABLE_END = "<!-- end of generated table -->"


def render_table(kernels) -> str:
    """The markdown table of every variable: the kernels' enable flags (`kernels`: KernelSpecs, in
    manifest order), then ENV_VARS."""
    rows = ["| variable | kind | default | read in | what it does |", "|---|---|---|---|---|"]
    for k in kernels:
        what = k.description.split(". ")[0].rstrip(".")
        rows.append(f"| `{k.enable.env}` | flag | {'on' if k.enable.default else 'off'} | kernels.yaml "
                    f"(registry/core.py) | Enable flag of `{k.name}` ({what}). `0` turns it "
                    f"off; `1` forces it on even where `prefer` (speed) says no, still subject to `requires` "
                    f"(correctness). |")
    for v in ENV_VARS:
        default = ("on" if parse_flag(v.name, v.default, False) else "off") if v.kind == "flag" else (v.default or "unset")
        rows.append(f"| `{v.name}` | {_KIND_LABEL[v.kind]} | {default} | {v.read_in} | {v.doc} |")
    return "\n".join(rows)


def table_in(text: str) -> str | None:
    """The generated table of a docs/env-vars.md text (between the markers), or None without markers."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return None
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n")


def parse_flag(name: str, raw: str | None, default: bool) -> bool:
    """Parse a boolean env flag: unset or empty -> default; 1/0/true/false/yes/no/on/off."""
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(
        f"environment variable {name}={raw!r}: expected one of 1/0/true/false/yes/no/on/off "
        f"(case-insensitive), or unset for the default ({'on' if default else 'off'})")


def flag_state(name: str, default: bool) -> tuple[bool, bool]:
    """(value, explicitly_set) for an enable flag declared in kernels.yaml."""
    raw = os.environ.get(name)
    explicit = raw is not None and raw.strip() != ""
    return parse_flag(name, raw, default), explicit


def get_flag(name: str) -> bool:
    var = _BY_NAME[name]
    return parse_flag(name, os.environ.get(name), parse_flag(name, var.default, False))


def get_float(name: str) -> float:
    var = _BY_NAME[name]
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return float(var.default)
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise EnvError(f"environment variable {name}={raw!r}: expected a positive number of seconds")
    return value


def get_path(name: str) -> Path | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return Path(raw).expanduser()


def get_list(name: str) -> tuple[str, ...]:
    """A comma-separated list: unset or empty -> (); blanks around items are dropped."""
    raw = os.environ.get(name)
    return tuple(item.strip() for item in (raw or "").split(",") if item.strip())


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def get_log_level(name: str = "MLX_AOT_LOG_LEVEL") -> str | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    level = raw.strip().upper()
    if level not in _LEVELS:
        raise EnvError(f"environment variable {name}={raw!r}: expected one of {', '.join(_LEVELS)}")
    return level
