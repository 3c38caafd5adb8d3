"""Packaging: the library is the only installed package and imports without Dagster (an optional
extra); the Dagster side loads from the project directory."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every eagle3_platform module, imported where `import dagster` (and its helpers) fails.
IMPORT_ALL_WITHOUT_DAGSTER = r"""
import importlib, pkgutil, sys

class NoDagster:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dagster", "dagster_pipes", "dagster_gcp", "dagster_webserver"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

sys.meta_path.insert(0, NoDagster())
import eagle3_platform
names = sorted(m.name for m in pkgutil.walk_packages(eagle3_platform.__path__, "eagle3_platform."))
# the Locust user gets a process of its own (as in `eagle3 bench`): importing locust monkey-patches
# the standard library with gevent, which breaks modules imported before it
LOCUST = "eagle3_platform.bench.locustfile"
assert LOCUST in names
names = [LOCUST] if sys.argv[1] == "locust" else [n for n in names if n != LOCUST]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def _import_without_dagster(which: str) -> int:
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL_WITHOUT_DAGSTER, which], cwd=ROOT / "tests",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.strip().splitlines()[-1])


def test_every_library_module_imports_without_dagster():
    assert _import_without_dagster("all") > 50  # really walked the package
    assert _import_without_dagster("locust") == 1


def test_only_the_library_is_installed():
    """assets/resources/definitions are generic names: never installed into site-packages."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["tool"]["setuptools"]["packages"]["find"]["include"] == ["eagle3_platform*"]
    assert "py-modules" not in cfg["tool"]["setuptools"]
    deps = {d.split("==")[0] for d in cfg["project"]["dependencies"]}
    assert not deps & {"dagster", "dagster-webserver", "dagster-gcp"}
    assert all("==" in d for extra in cfg["project"]["optional-dependencies"].values() for d in extra)  # exact pins
    assert cfg["tool"]["dagster"]["module_name"] == "definitions"
    r = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                        "print([m for m in ('assets', 'resources', 'definitions') if u.find_spec(m)])"],
                       cwd="/", capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_pod_image_installs_what_setup_installs():
    """The Dockerfile (the Kubernetes pods' image, docs/PRODUCTION.md) installs the pins scripts/setup.sh
    installs, extras pyproject.toml defines, and copies paths that exist: it cannot drift from the
    tested setup unnoticed (it is not built here: no base-image registry is reachable)."""
    import re

    docker, setup = (ROOT / "Dockerfile").read_text(), (ROOT / "scripts" / "setup.sh").read_text()
    pins = lambda text: set(re.findall(r"\b([a-z][\w.-]*==[\w.]+)", text))  # noqa: E731
    assert pins(docker) == pins(setup) and "torch==2.13.0" in pins(docker)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (wanted,) = re.findall(r'-e "\.\[([\w,-]+)\]"', docker)
    assert set(wanted.split(",")) <= set(extras) and "dev" not in wanted.split(",")
    for line in docker.splitlines():
        if line.startswith("COPY "):
            assert all((ROOT / src).exists() for src in line.split()[1:-1]), line
    assert (ROOT / "resources" / "pipes_worker.py").exists()
