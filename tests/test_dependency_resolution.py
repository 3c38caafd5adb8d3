"""Every documented install resolves for Linux x86-64, CPython 3.11 (`uv pip compile`, nothing
installed): the project's extras as README / docs/PRODUCTION.md / scripts/setup.sh name them, and the
SGLang environment of scripts/sglang-requirements.txt, which cannot share the project's pins."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
SGLANG_PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_34"]  # its wheels' tag
SGLANG_REQ = ROOT / "scripts" / "sglang-requirements.txt"
# (why, extras): what the docs tell a user to install
DOCUMENTED = [
    ("scripts/setup.sh (the laptop / CI venv)", "dev,data,dagster,k8s"),
    ("docs/PRODUCTION.md (a GPU node or a pod image)", "data,dagster,gcp,k8s"),
    ("the library alone", ""),
    ("every extra", "data,dagster,gcp,k8s,dev"),
]
pytestmark = pytest.mark.integration


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not uv:
        pytest.fail("uv is missing: it is pinned in the dev extra (bash scripts/setup.sh installs it)")
    return uv


@pytest.fixture(scope="module", autouse=True)
def pypi_reachable():
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as e:
        pytest.skip(f"PyPI is not reachable from here ({e}): resolution needs the package index")


def compile_(args: list[str], tmp_path: Path, name: str) -> dict[str, str]:
    """`uv pip compile` -> {package: version} of the lock, or the resolver's error as the failure."""
    out = tmp_path / f"{name}.txt"
    r = subprocess.run([_uv(), "pip", "compile", "-q", "--no-header", *args, "-o", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name} does not resolve:\n{r.stderr[-3000:]}"
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", out.read_text(), re.M)
    return {n.lower().replace("_", "-"): v for n, v in pins}


def base_pins() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return dict(d.lower().split("==") for d in deps)


@pytest.mark.parametrize("why,extras", DOCUMENTED, ids=[e or "base" for _, e in DOCUMENTED])
def test_documented_extras_resolve(why, extras, tmp_path):
    flags = [f for e in extras.split(",") if e for f in ("--extra", e)]
    lock = compile_(["pyproject.toml", *flags, *PLATFORM], tmp_path, extras or "base")
    for name, version in base_pins().items():  # every base pin holds with these extras
        assert lock.get(name) == version, f"{why}: {name} resolved {lock.get(name)}, pinned {version}"
    if "k8s" in extras:
        assert "dagster-k8s" in lock and "kubernetes" in lock


def test_every_extra_is_in_a_documented_combination():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    covered = {e for _, combo in DOCUMENTED for e in combo.split(",") if e}
    assert extras == covered


def test_setup_installs_the_combination_tested_here():
    m = re.search(r'-e "\.\[([a-z0-9,]+)\]"', (ROOT / "scripts" / "setup.sh").read_text())
    assert m, "scripts/setup.sh installs the project with extras"
    assert set(m.group(1).split(",")) == set(DOCUMENTED[0][1].split(","))


def test_sglang_environment_resolves_with_its_own_pins(tmp_path):
    lock = compile_([str(SGLANG_REQ.relative_to(ROOT)), *SGLANG_PLATFORM], tmp_path, "sglang")
    wanted = dict(re.findall(r"^([a-z0-9\-]+)==(\S+)", SGLANG_REQ.read_text(), re.M))
    assert wanted["sglang"] == "0.5.23"
    assert {k: lock.get(k) for k in wanted} == wanted
    # and why it is an environment of its own: its torch is not the project's
    assert lock["torch"] != base_pins()["torch"]


def test_sglang_cannot_share_the_project_environment(tmp_path):
    """The reason for the second environment, kept checked: if a later sglang stops pinning other
    torch/transformers/tokenizers than the base, this fails and the environments could merge."""
    req = tmp_path / "together.in"
    req.write_text(f"-e {ROOT}\n" + SGLANG_REQ.read_text())
    r = subprocess.run([_uv(), "pip", "compile", "-q", str(req), *SGLANG_PLATFORM, "-o", str(tmp_path / "x.txt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "unsatisfiable" in r.stderr, r.stderr[-2000:]


def test_sglang_env_script_checks_resolution():
    r = subprocess.run(["bash", "scripts/sglang_env.sh", "--check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
