"""README.md and docs/ against what they describe: CI's command, the links, the headline table."""

from __future__ import annotations

import re

from benchmarks import report
from registry.paths import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"


def test_ci_runs_the_readme_test_command():
    ci = (PROJECT_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README.read_text(), f".ci/run's command is not README.md's test command: {ci}"


def test_relative_links_resolve():
    """Every relative markdown link of README.md and docs/ names a file of the checkout (result files
    removed from docs/benchmarks/ are in git history, linked as `git show ...`, not as files)."""
    broken = []
    for md in [README, *sorted((PROJECT_ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" not in target and not (md.parent / target).exists():
                broken.append(f"{md.relative_to(PROJECT_ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_readme_table_is_the_committed_h200_run():
    """The headline table is printed by `bench --e2e --from-json docs/benchmarks/e2e-h200.json`; after
    a new run, paste that table into README.md."""
    cells, _ = report.load_e2e_json(PROJECT_ROOT / "docs" / "benchmarks" / "e2e-h200.json")
    table = report.dropin_summary(cells)
    assert table and table in README.read_text(), (
        "README.md's table differs from docs/benchmarks/e2e-h200.json: paste the table that "
        "`python -m build_tools bench --e2e --from-json docs/benchmarks/e2e-h200.json` prints")
