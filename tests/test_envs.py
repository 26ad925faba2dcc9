"""Env parsing: one module, one set of rules, documented in docs/env-vars.md (checked here)."""

from __future__ import annotations

import re

import pytest

from registry import envs
from registry.errors import EnvError
from registry.paths import PROJECT_ROOT


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_flag_values(raw, expected):
    assert envs.parse_flag("X", raw, default=not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_and_empty_mean_default(default):
    assert envs.parse_flag("X", None, default) is default
    assert envs.parse_flag("X", "", default) is default
    assert envs.parse_flag("X", "  ", default) is default


@pytest.mark.parametrize("raw", ["2", "y", "enable", "tru", "-1", "none"])
def test_bad_flag_names_variable_and_choices(raw):
    with pytest.raises(EnvError, match=r"MLX_AOT_X=.*expected one of 1/0/true/false/yes/no/on/off"):
        envs.parse_flag("MLX_AOT_X", raw, True)


def test_flag_state_reports_explicitness(monkeypatch):
    monkeypatch.delenv("MLX_AOT_T", raising=False)
    assert envs.flag_state("MLX_AOT_T", True) == (True, False)
    monkeypatch.setenv("MLX_AOT_T", "off")
    assert envs.flag_state("MLX_AOT_T", True) == (False, True)


def test_float_and_level_validation(monkeypatch):
    monkeypatch.setenv("MLX_AOT_LOCK_TIMEOUT", "abc")
    with pytest.raises(EnvError, match="MLX_AOT_LOCK_TIMEOUT='abc'"):
        envs.get_float("MLX_AOT_LOCK_TIMEOUT")
    monkeypatch.setenv("MLX_AOT_LOCK_TIMEOUT", "-3")
    with pytest.raises(EnvError, match="positive"):
        envs.get_float("MLX_AOT_LOCK_TIMEOUT")
    monkeypatch.setenv("MLX_AOT_LOCK_TIMEOUT", "2.5")
    assert envs.get_float("MLX_AOT_LOCK_TIMEOUT") == 2.5
    monkeypatch.setenv("MLX_AOT_LOG_LEVEL", "loud")
    with pytest.raises(EnvError, match="DEBUG, INFO"):
        envs.get_log_level()
    monkeypatch.setenv("MLX_AOT_LOG_LEVEL", "debug")
    assert envs.get_log_level() == "DEBUG"


def test_docs_table_matches_code():
    """docs/env-vars.md's table is the one generated from envs.ENV_VARS and kernels.yaml."""
    from registry.manifest import load_manifest

    text = (PROJECT_ROOT / "docs" / "env-vars.md").read_text()
    table = envs.table_in(text)
    assert table is not None, "docs/env-vars.md: the generated-table markers are missing"
    assert table == envs.render_table(load_manifest().kernels), (
        "docs/env-vars.md is out of date with registry/envs.py and kernels.yaml: run "
        "`python -m build_tools env-table --write` and commit docs/env-vars.md")
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", text, flags=re.M))
    declared = {v.name for v in envs.ENV_VARS} | {k.enable.env for k in load_manifest().kernels}
    assert documented == declared
    for v in envs.ENV_VARS:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{v.name}` |"))
        assert v.read_in in row, f"docs/env-vars.md row for {v.name} must say it is read in {v.read_in}"


def test_env_table_command_checks_and_rewrites(tmp_path):
    """The generated table changes with the manifest: a new kernel's enable flag appears in it, and
    the check fails naming the file and the command while the docs lag behind."""
    from click.testing import CliRunner

    from build_tools.cli import cli
    from registry.manifest import load_manifest

    kernels = load_manifest().kernels
    fewer = envs.render_table(kernels[:1])
    assert kernels[-1].enable.env in envs.render_table(kernels) and kernels[-1].enable.env not in fewer
    doc = tmp_path / "env-vars.md"
    doc.write_text(f"intro\n{envs.TABLE_BEGIN}\n{fewer}\n{envs.TABLE_END}\nafter\n")
    result = CliRunner().invoke(cli, ["env-table", "--file", str(doc)])
    assert result.exit_code == 1 and "env-vars.md: the table differs" in result.output
    assert "python -m build_tools env-table --write" in result.output
    result = CliRunner().invoke(cli, ["env-table", "--file", str(doc), "--write"])
    assert result.exit_code == 0, result.output
    text = doc.read_text()
    assert envs.table_in(text) == envs.render_table(kernels) and text.startswith("intro") and text.endswith("after\n")
    assert CliRunner().invoke(cli, ["env-table", "--file", str(doc)]).exit_code == 0


def test_no_other_module_reads_environment_directly():
    """All env access goes through registry/envs.py (build tools and benchmarks included)."""
    offenders = []
    for folder in ("registry", "build_tools"):
        for path in (PROJECT_ROOT / folder).rglob("*.py"):
            if path.name == "envs.py":
                continue
            text = path.read_text()
            if re.search(r"os\.environ\.get\(\s*[\"']MLX_AOT|os\.getenv\(\s*[\"']MLX_AOT", text):
                offenders.append(str(path.relative_to(PROJECT_ROOT)))
    assert not offenders, f"read MLX_AOT_* variables through registry.envs: {offenders}"
