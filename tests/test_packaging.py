"""pyproject.toml is the source of truth; environment.yml mirrors it (design.md §7)."""
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# PyPI → conda-forge, where they differ
CONDA_NAMES = {"torch": "pytorch", "uvicorn[standard]": "uvicorn-standard"}


def _name(req: str) -> str:
    """The name with its extras, e.g. 'uvicorn[standard]'."""
    m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?", req)
    return (m.group(1).lower().replace("_", "-") + (m.group(2) or ""))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment_deps() -> dict[str, str]:
    deps, in_deps = {}, False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            in_deps = True
            continue
        m = re.match(r"\s+- ([A-Za-z0-9_.-]+)(.*)$", line)
        if in_deps and m:
            deps[m.group(1).lower().replace("_", "-")] = m.group(2).strip()
    return deps


def test_environment_yml_mirrors_pyproject():
    proj = _pyproject()["project"]
    reqs = proj["dependencies"] + proj["optional-dependencies"]["test"]
    env = _environment_deps()
    for req in reqs:
        name = _name(req)
        conda = CONDA_NAMES.get(name, name)
        assert conda in env, f"{name} is in pyproject.toml but not in environment.yml"
        spec = req[len(name):].split(";")[0].strip()
        assert env[conda] == spec, f"{name}: pyproject says {spec!r}, environment.yml says {env[conda]!r}"
    extra = set(env) - {CONDA_NAMES.get(_name(r), _name(r)) for r in reqs} - {"python", "pip"}
    assert not extra, f"environment.yml lists {extra} that pyproject.toml does not"


def test_no_exact_pins():
    proj = _pyproject()["project"]
    for req in proj["dependencies"] + proj["optional-dependencies"]["test"]:
        assert "==" not in req, f"exact pin {req!r}: use a range"
    assert "==" not in (ROOT / "environment.yml").read_text().split("dependencies:")[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = 'pip install -e ".[test]" && python -m pytest'
    assert cmd in readme and cmd in ci


def test_tokenizer_asset_is_packaged():
    assert "assets/**/*" in _pyproject()["tool"]["setuptools"]["package-data"]["minillm"]
    assert (ROOT / "minillm" / "assets" / "tokenizer" / "tokenizer.json").exists()
