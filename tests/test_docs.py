"""What a newcomer reads must match what the code does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_sys.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def test_spec_reference_is_current():
    out = subprocess.run([sys.executable, "scripts/spec_reference.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("job", sorted(p.name for p in (ROOT / "jobs").glob("*.yaml")))
def test_every_example_job_is_a_valid_spec(job):
    load_spec(ROOT / "jobs" / job)


def test_readme_commands_exist():
    readme = (ROOT / "README.md").read_text()
    for script in re.findall(r"bash (scripts/\w+\.sh)", readme):
        assert (ROOT / script).exists(), script
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    # Every spec field the README's table names exists.
    for dotted in re.findall(r"\| `((?:train|resources|elastic|checkpoint|parallel|data|tracking)\.\w+)`", readme):
        section, name = dotted.split(".")
        assert f"| `{name}` |" in (ROOT / "docs" / "spec_reference.md").read_text(), dotted


def test_the_package_says_the_version_pyproject_installs():
    import tomllib

    import raytrain_sys
    from raytrain_sys.version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__ == raytrain_sys.__version__
