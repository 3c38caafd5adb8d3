"""What code an asset can run: the top-level statements of the project's modules (eagle3_platform/,
assets/, resources/) that its definition reaches, found by parsing the source, never importing it.

From the asset's function (decorators, its parameters' resource classes, body) every name is
followed to the statement that defines it: the module's own definitions, and through `import` and
`from ... import` statements, top-level or inside a function (lazy), absolute or relative, to the
definition in the imported module; a package's names through its `__init__.py`, whose re-export
counts. A module the reach uses also brings its statements that act on import (a registration, an
environment default), and those of its packages' `__init__.py`. The unit is a top-level statement:
a class counts with all its methods, a module used as a value (not `module.name`) counts whole. A
statement is hashed as its syntax tree without docstrings, so comments and layout change nothing.

What the code loads by a string:
- a project module run as a program (`[python, "-m", "resources.pipes_worker"]`; a package: its
  `__main__.py` too) or a `.py` file named beside its module (`with_name("locustfile.py")`) counts
  whole, `__main__` block included;
- `eagle3_platform.stage` loads each area's stages module by name and runs `RUNNERS[type(request)]`
  from it: a request class brings the runner its table pairs it with; the names only load modules;
- `eagle3_platform.cli` loads each area's command module by name and runs the handler of one subcommand:
  a command that spells it (`-m eagle3_platform.cli serve`) brings the area registering it, one that
  does not (`-m eagle3_platform.cli *args`) brings every area;
- any other dotted string equal to a project module's name counts that module whole (except in
  this module, which names modules as data).
Another asset named in a decorator (`deps=[...]`) is lineage, not code this asset runs.
"""
from __future__ import annotations

import ast
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("eagle3_platform", "assets", "resources")
ASSET_DECORATORS = ("asset", "multi_asset", "observable_source_asset")
STAGE, CLI, RUNNERS = "eagle3_platform.stage", "eagle3_platform.cli", "RUNNERS"
NAMES_ONLY = (STAGE, CLI, __name__)  # their strings name modules without loading them (see above)

Stmt = tuple[str, int]  # (module name, index of a top-level statement)


@dataclass
class Module:
    name: str
    rel: str
    package: str  # what a relative import starts from
    stmts: list[ast.stmt]
    defines: dict[str, list[int]] = field(default_factory=dict)
    imports: dict[str, tuple[int, tuple | None]] = field(default_factory=dict)  # name -> (stmt, target)
    on_import: list[int] = field(default_factory=list)
    main: list[int] = field(default_factory=list)
    pairs: dict[str, str] = field(default_factory=dict)  # RUNNERS: request class -> runner


class Project:
    """The parsed sources under one root, each module parsed once."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._modules: dict[str, Module | None] = {}

    # -- modules ------------------------------------------------------------------------------
    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            path = self.path(name)
            self._modules[name] = self._load(name, path) if path else None
        return self._modules[name]

    @functools.cache
    def path(self, name: str) -> Path | None:
        """The file of a project module, None for anything else."""
        if name.split(".")[0] not in PACKAGES or not all(p.isidentifier() for p in name.split(".")):
            return None
        base = self.root / name.replace(".", "/")
        path = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
        return path if path.is_file() else None

    def _load(self, name: str, path: Path) -> Module:
        tree = _without_docstrings(ast.parse(path.read_text(), filename=str(path)))
        is_pkg = path.name == "__init__.py"
        m = Module(name, str(path.relative_to(self.root)), name if is_pkg else name.rpartition(".")[0],
                   tree.body)
        for i, s in enumerate(m.stmts):
            self._index(m, i, s)
        return m

    def _index(self, m: Module, i: int, s: ast.stmt) -> None:
        if _is_guard(s, "TYPE_CHECKING"):
            return  # never runs
        if _is_guard(s, "__main__"):
            m.main.append(i)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for name, target in self._bindings(m, s):
                m.imports[name] = (i, target)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            m.defines.setdefault(s.name, []).append(i)
        elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and _names(s):
            for name in _names(s):
                m.defines.setdefault(name, []).append(i)
            if RUNNERS in _names(s) and isinstance(s.value, ast.Dict):
                m.pairs.update({k.id: v.id for k, v in zip(s.value.keys, s.value.values)
                                if isinstance(k, ast.Name) and isinstance(v, ast.Name)})
        else:
            m.on_import.append(i)

    def _bindings(self, m: Module, s: ast.Import | ast.ImportFrom):
        """(name bound, target) of one import statement; target None outside the project."""
        if isinstance(s, ast.Import):
            for a in s.names:
                name = a.name if a.asname else a.name.split(".")[0]
                yield a.asname or name, self._target(name, None)
            return
        base = s.module or ""
        if s.level:
            parts = m.package.split(".")
            parts = parts[:len(parts) - s.level + 1]
            base = ".".join(parts + ([base] if base else []))
        for a in s.names:
            yield a.asname or a.name, self._target(base, a.name)

    def _target(self, base: str, attr: str | None):
        if self.path(base) is None:
            return None
        if attr is None or self.path(f"{base}.{attr}"):
            return ("module", base if attr is None else f"{base}.{attr}")
        return ("name", base, attr)

    # -- assets -------------------------------------------------------------------------------
    @functools.cached_property
    def assets(self) -> dict[str, Stmt]:
        """Asset name -> its defining statement, for every decorated asset function in assets/."""
        found = {}
        for path in sorted((self.root / "assets").glob("*.py")):
            m = self.module(f"assets.{path.stem}") if path.stem != "__init__" else None
            for i, s in enumerate(m.stmts if m else ()):
                name = _asset_name(s)
                if name:
                    found[name] = (m.name, i)
        return found

    # -- the reach ----------------------------------------------------------------------------
    @functools.cache
    def reach(self, asset: str) -> frozenset[Stmt]:
        root = self.assets[asset]
        others = set(self.assets.values()) - {root}
        seen: set[Stmt] = set()
        used: set[str] = set()
        todo = [root]
        while todo:
            stmt = todo.pop()
            if stmt in seen or stmt in others:
                continue
            seen.add(stmt)
            if stmt[0] not in used:
                used.add(stmt[0])
                todo += self._on_import(stmt[0])
            todo += self._follow(stmt)
        return frozenset(seen)

    def _on_import(self, name: str) -> list[Stmt]:
        parts = name.split(".")
        out = []
        for k in range(1, len(parts) + 1):
            m = self.module(".".join(parts[:k]))
            out += [(m.name, i) for i in m.on_import] if m else []
        return out

    @functools.cache
    def _follow(self, stmt: Stmt) -> list[Stmt]:
        m = self.module(stmt[0])
        out = []
        for ref in self._statement_refs(stmt):
            kind, value, extra = ref
            if kind == "chain":
                out += self._chain(m, value, extra)
            elif kind == "program":
                out += self._program(value, extra)
            elif kind == "named" and m.name not in NAMES_ONLY:
                out += self._whole(value)
        return out

    def _chain(self, m: Module, chain: list[str], local: dict) -> list[Stmt]:
        head, rest = chain[0], chain[1:]
        if head in local:
            return self._resolve(local[head], rest)
        if head in m.defines:
            return self._defined(m, head)
        if head in m.imports:
            i, target = m.imports[head]
            return [(m.name, i)] + (self._resolve(target, rest) if target else [])
        return []  # a builtin or a local variable

    def _resolve(self, target: tuple, attrs: list[str]) -> list[Stmt]:
        out: list[Stmt] = []
        while True:
            if target[0] == "module":
                if not attrs:
                    return out + self._whole(target[1])
                target, attrs = self._target(target[1], attrs[0]), attrs[1:]
                continue
            m, name = self.module(target[1]), target[2]
            if name in m.defines:
                return out + self._defined(m, name)
            if name not in m.imports:
                return out + self._whole(m.name)  # bound some other way: count the module
            i, next_target = m.imports[name]
            out.append((m.name, i))  # a re-export (a package's __init__.py)
            if next_target is None:
                return out
            target = next_target

    def _defined(self, m: Module, name: str) -> list[Stmt]:
        out = [(m.name, i) for i in m.defines[name]]
        if name in m.pairs:
            out += self._defined(m, m.pairs[name]) if m.pairs[name] in m.defines else []
        return out

    def _whole(self, name: str) -> list[Stmt]:
        m = self.module(name)
        skip = set(m.main) if m else set()
        return [(m.name, i) for i, s in enumerate(m.stmts if m else ())
                if i not in skip and not _is_guard(s, "TYPE_CHECKING")]

    def _program(self, name: str, subcommand: str | None) -> list[Stmt]:
        out = self._run(name)
        if self.module(name).rel.endswith("__init__.py"):  # `-m package` runs its __main__.py
            out += self._run(f"{name}.__main__")
        if name == CLI:  # the area registering the subcommand; every area where the command hides it
            areas = self.cli_areas()
            chosen = [a for a, commands in areas.items() if subcommand in commands] or list(areas)
            out += [s for a in chosen for s in self._whole(a)]
        return out

    def _run(self, name: str) -> list[Stmt]:
        m = self.module(name)
        return self._whole(name) + [(name, i) for i in m.main] if m else []

    def cli_areas(self) -> dict[str, set[str]]:
        """eagle3_platform.cli and its area modules -> the subcommands each registers (`add_parser`)."""
        cli = self.module(CLI)
        names = [v for i in cli.defines.get("AREAS", ()) for v in _strings(cli.stmts[i])] if cli else []
        out = {}
        for name in [CLI, *names] if cli else []:
            m = self.module(name)
            out[name] = {c.args[0].value for s in (m.stmts if m else ()) for c in ast.walk(s)
                         if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "add_parser"
                         and c.args and isinstance(c.args[0], ast.Constant)}
        return out

    def _statement_refs(self, stmt: Stmt) -> list:
        m = self.module(stmt[0])
        return _Refs(self, m).of(m.stmts[stmt[1]])

    # -- what callers use ---------------------------------------------------------------------
    @functools.cache
    def files(self, asset: str) -> frozenset[str]:
        return frozenset(self.module(name).rel for name, _ in self.reach(asset))

    @functools.cache
    def source_hash(self, asset: str) -> str:
        h = hashlib.sha256()
        for rel, digest in sorted((self.module(s[0]).rel, self._digest(s)) for s in self.reach(asset)):
            h.update(f"{rel}\0{digest}\0".encode())
        return h.hexdigest()

    @functools.cache
    def _digest(self, stmt: Stmt) -> str:
        return hashlib.sha256(ast.dump(self.module(stmt[0]).stmts[stmt[1]]).encode()).hexdigest()


class _Refs(ast.NodeVisitor):
    """What one top-level statement names: name chains (`a.b.c`, resolved with the statement's own
    imports first), project modules run as programs, strings naming project modules."""

    def __init__(self, project: Project, module: Module):
        self.project, self.module = project, module
        self.local: dict[str, tuple] = {}
        self.refs: list = []
        self.consumed: set[int] = set()

    def of(self, stmt: ast.stmt) -> list:
        if not isinstance(stmt, (ast.Import, ast.ImportFrom)):  # a top-level import only binds
            for node in ast.walk(stmt):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    self.local.update({k: v for k, v in self.project._bindings(self.module, node) if v})
            self.visit(stmt)
            for text in _quoted_annotations(stmt):  # `-> "Config"`: pydantic and dagster evaluate them
                self.visit(text)
        return [(kind, value, self.local if kind == "chain" else extra) for kind, value, extra in self.refs]

    def visit_Name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Store):
            self.refs.append(("chain", [node.id], None))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name):
            self.refs.append(("chain", [base.id, *chain], None))
        else:
            self.visit(base)

    def _sequence(self, node: ast.List | ast.Tuple) -> None:
        elts = node.elts
        for k, e in enumerate(elts[:-1]):
            module = _const(elts[k + 1])
            if _const(e) == "-m" and isinstance(module, str) and self.project.path(module):
                nxt = _const(elts[k + 2]) if k + 2 < len(elts) else None
                sub = nxt if isinstance(nxt, str) and not nxt.startswith("-") else None
                self.refs.append(("program", module, sub))
                self.consumed.add(id(elts[k + 1]))
        self.generic_visit(node)

    visit_List = visit_Tuple = _sequence

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if not isinstance(v, str) or id(node) in self.consumed:
            return
        if "." in v and self.project.path(v):  # dotted: a bare "assets" is a path part or a key
            self.refs.append(("named", v, None))
        elif v.endswith(".py") and v[:-3].isidentifier() and v != "__init__.py":
            sibling = f"{self.module.package}.{v[:-3]}" if self.module.package else v[:-3]
            if self.project.path(sibling):
                self.refs.append(("program", sibling, None))


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            if isinstance(_const(node.body[0]) if isinstance(node.body[0], ast.Expr) else None, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _quoted_annotations(stmt: ast.stmt) -> list[ast.expr]:
    out = []
    for node in ast.walk(stmt):
        if isinstance(node, ast.arg):
            annotations = [node.annotation]
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations = [node.returns]
        else:
            continue
        for c in (n for a in annotations if a is not None for n in ast.walk(a)):
            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                try:
                    out.append(ast.parse(c.value, mode="eval").body)
                except SyntaxError:
                    pass  # a Literal's value, not a name
    return out


def _const(node):
    if isinstance(node, ast.Expr):
        node = node.value
    return node.value if isinstance(node, ast.Constant) else None


def _is_guard(s: ast.stmt, what: str) -> bool:
    """`if TYPE_CHECKING:` or `if __name__ == "__main__":`."""
    if not isinstance(s, ast.If):
        return False
    t = s.test
    if what == "TYPE_CHECKING":
        return (isinstance(t, ast.Name) and t.id == what) or (isinstance(t, ast.Attribute) and t.attr == what)
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and _const(t.comparators[0]) == "__main__")


def _names(s) -> list[str]:
    """The names an assignment binds (none where it sets an attribute or an item: that acts)."""
    targets = [t for t in (s.targets if isinstance(s, ast.Assign) else [s.target])
               if isinstance(t, (ast.Name, ast.Tuple))]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _strings(s: ast.stmt) -> list[str]:
    return [n.value for n in ast.walk(s) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _asset_name(s: ast.stmt) -> str | None:
    if not isinstance(s, ast.FunctionDef):
        return None
    for d in s.decorator_list:
        fn = d.func if isinstance(d, ast.Call) else d
        if getattr(fn, "id", getattr(fn, "attr", None)) in ASSET_DECORATORS:
            named = [k.value for k in getattr(d, "keywords", ()) if k.arg in ("name", "key")]
            return _const(named[0]) if named and isinstance(_const(named[0]), str) else s.name
    return None


@functools.lru_cache(maxsize=None)
def project(root: Path) -> Project:
    """One parsed project per root and process (the code location computes versions once, at load)."""
    return Project(root)
