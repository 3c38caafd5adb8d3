"""The dependency direction (docs/ARCHITECTURE.md §2): eagle3_platform never imports Dagster (or the
Dagster layer); assets/ and resources/ build on eagle3_platform, never the reverse."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DAGSTER_SIDE = ("dagster", "dagster_pipes", "dagster_gcp", "dagster_webserver", "dagster_k8s",
                "assets", "resources", "definitions")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def test_library_never_imports_dagster_side():
    offenders = {}
    for py in sorted((ROOT / "eagle3_platform").rglob("*.py")):
        bad = sorted(m for m in imported_modules(py) if _top(m) in DAGSTER_SIDE)
        if bad:
            offenders[str(py.relative_to(ROOT))] = bad
    assert not offenders, f"eagle3_platform must not import the Dagster layer: {offenders}"


def test_test_doubles_stay_out_of_production():
    """eagle3_platform.testing (fakes, oracle drafter, synthetic data) is for tests and scripts only."""
    production = [*(ROOT / "eagle3_platform").rglob("*.py"), *(ROOT / "assets").rglob("*.py"),
                  *(ROOT / "resources").rglob("*.py"), ROOT / "definitions.py"]
    offenders = {str(py.relative_to(ROOT)): sorted(m for m in imported_modules(py) if m.startswith("eagle3_platform.testing"))
                 for py in production if "testing" not in py.relative_to(ROOT).parts}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"production code imports test doubles: {offenders}"


def test_dagster_layer_builds_on_the_library():
    for pkg in ("assets", "resources"):
        files = sorted((ROOT / pkg).rglob("*.py"))
        assert files, f"{pkg}/ is empty"
        uses = [f for f in files if any(_top(m) == "eagle3_platform" for m in imported_modules(f))]
        assert uses, f"{pkg}/ never calls the library"


def test_cli_import_does_not_load_dagster():
    """Assembling the whole `eagle3` CLI (every area, `run` included) must not pull Dagster in."""
    code = ("import sys; from eagle3_platform.cli import build_parser; build_parser(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_pipes')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"dagster loaded by the library CLI: {r.stdout} {r.stderr[-2000:]}"


def test_layering_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom dagster import asset\nimport importlib\nimportlib.import_module('resources.storage')\n")
    assert {"dagster", "resources.storage"} <= imported_modules(bad)
