"""The dependency direction (docs/ARCHITECTURE.md §2): eagle3_platform never imports Dagster (or the
Dagster layer); assets/ and resources/ build on eagle3_platform, never the reverse; inside the library
each package imports only its own layer and those below it, no two packages import each other, and no
module reaches for another's private names."""
import ast
import subprocess
import sys
from dataclasses import dataclass
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


def test_cli_import_does_not_load_dagster_or_torch():
    """Assembling the whole `eagle3` CLI (every area, `run` included) must not pull Dagster in, nor
    torch: the area modules are loaded by name and import a stage's code when its command runs."""
    code = ("import sys; from eagle3_platform.cli import build_parser; build_parser(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_pipes', 'torch')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"dagster or torch loaded by the library CLI: {r.stdout} {r.stderr[-2000:]}"


def test_layering_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom dagster import asset\nimport importlib\nimportlib.import_module('resources.storage')\n")
    assert {"dagster", "resources.storage"} <= imported_modules(bad)


# ---- the library's own layers ---------------------------------------------------------------------
# A package imports its own layer and those below it, never one above: store <- model <- data,
# features, draft <- spec <- serve, bench <- cli (and the test doubles). config.py and stage.py are
# neutral, importable from every layer: config composes each area's presets and stage dispatches to
# each area's stages module, both when called (a function-local import, a module loaded by name),
# never on import; those imports are the only ones that go up.
LAYERS = {"store": 0, "config": 0, "stage": 0, "progress": 0, "model": 1, "data": 2, "features": 2, "draft": 2,
          "spec": 3, "serve": 4, "bench": 4, "cli": 5, "testing": 5}
DISPATCHERS = ("config", "stage")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    names: tuple[str, ...]  # what `from target import ...` takes that is no module of its own
    when_called: bool  # inside a function or under TYPE_CHECKING: not run when the source is imported
    line: int


def library_imports(root: Path, lib: str = "eagle3_platform") -> list[Import]:
    """Every import of a library module by a library module: top-level and function-local, absolute
    and relative, `importlib.import_module("...")` with a literal name."""
    found = []
    for path in sorted((root / lib).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else name.rpartition(".")[0]
        found += _Imports(root, lib, name, package).of(ast.parse(path.read_text(), filename=str(path)))
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self, root: Path, lib: str, module: str, package: str):
        self.root, self.lib, self.module, self.package = root, lib, module, package
        self.depth, self.found = 0, []

    def of(self, tree: ast.Module) -> list[Import]:
        self.visit(tree)
        return self.found

    def is_module(self, name: str) -> bool:
        base = self.root / name.replace(".", "/")
        return (base / "__init__.py").is_file() or base.with_suffix(".py").is_file()

    def add(self, target: str, names: tuple[str, ...], node: ast.AST) -> None:
        if target.split(".")[0] == self.lib:
            self.found.append(Import(self.module, target, names, self.depth > 0, node.lineno))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.add(a.name, (), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        taken = []
        for a in node.names:
            if self.is_module(f"{base}.{a.name}"):
                self.add(f"{base}.{a.name}", (), node)
            else:
                taken.append(a.name)
        if taken:
            self.add(base, tuple(taken), node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if fn in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            self.add(str(node.args[0].value), (), node)
        self.generic_visit(node)

    def _nested(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_If(self, node: ast.If) -> None:
        if getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            self._nested(node)
        else:
            self.generic_visit(node)


def package_of(module: str) -> str | None:
    """eagle3_platform.spec.engine -> spec; eagle3_platform.config -> config; the root -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_edges(imports: list[Import], of=package_of) -> dict[str, set[str]]:
    """Package (or, with of=str, module) -> those it imports, less the dispatchers' imports when called."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        a, b = of(i.source), of(i.target)
        if a and b and a != b and not (package_of(i.source) in DISPATCHERS and i.when_called):
            edges.setdefault(a, set()).add(b)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan): each group imports itself."""
    index, low, stack, out = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def private_imports(imports: list[Import]) -> list[str]:
    return [f"{i.source}:{i.line} takes {n} from {i.target}" for i in imports if i.target != i.source
            for n in i.names if n.startswith("_") and not n.startswith("__")]


def upward_imports(imports: list[Import]) -> list[str]:
    out = []
    for i in imports:
        a, b = package_of(i.source), package_of(i.target)
        if not a or not b or a == b or (a in DISPATCHERS and i.when_called):
            continue
        if b not in LAYERS:
            out.append(f"{i.source}:{i.line} imports {i.target}, which is no package of the library")
        elif LAYERS[b] > LAYERS[a]:
            out.append(f"{i.source}:{i.line} ({a}, layer {LAYERS[a]}) imports {i.target} (layer {LAYERS[b]})")
    return out


def test_every_library_package_has_a_layer():
    lib = ROOT / "eagle3_platform"
    packages = {p.parent.name for p in lib.glob("*/__init__.py")} | {
        p.stem for p in lib.glob("*.py") if p.name != "__init__.py"}
    assert packages == set(LAYERS)


def test_no_package_imports_a_layer_above_it():
    assert not upward_imports(library_imports(ROOT))


def test_no_two_packages_import_each_other_nor_two_modules():
    imports = library_imports(ROOT)
    assert not cycles(package_edges(imports))
    assert not cycles(package_edges(imports, of=str))


def test_no_module_takes_another_modules_private_names():
    assert not private_imports(library_imports(ROOT))


def test_the_import_checks_catch_a_cycle_an_upward_import_and_a_private_name(tmp_path):
    sources = {
        "__init__.py": "",
        "config.py": "def preset():\n    from eagle3_platform.data.filter import PRESETS\n    return PRESETS\n",
        "model/__init__.py": "",
        "model/forward.py": "def _norm():\n    pass\n",
        "data/__init__.py": "",
        "data/filter.py": "from eagle3_platform.config import preset\nPRESETS = {}\n",
        "spec/__init__.py": "",
        "spec/head.py": "from ..model.forward import _norm\n",  # relative, private
        "spec/engine.py": "def run():\n    import importlib\n    importlib.import_module('eagle3_platform.draft.ttt')\n",
        "draft/__init__.py": "",
        "draft/ttt.py": "def f():\n    from eagle3_platform.spec import engine\n",  # function-local, upward
    }
    for rel, text in sources.items():
        path = tmp_path / "eagle3_platform" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    imports = library_imports(tmp_path)
    assert cycles(package_edges(imports)) == [["draft", "spec"]]  # config -> data when called is allowed
    assert cycles(package_edges(imports, of=str)) == [["eagle3_platform.draft.ttt", "eagle3_platform.spec.engine"]]
    assert [u.split(" ")[0] for u in upward_imports(imports)] == ["eagle3_platform.draft.ttt:2"]
    assert private_imports(imports) == ["eagle3_platform.spec.head:1 takes _norm from eagle3_platform.model.forward"]
