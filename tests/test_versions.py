"""Code versions derived from the source: each asset's code is what its definition reaches through
imports (assets/closure.py), so a change deep in the library makes exactly the assets that run it
stale, in Dagster's own staleness, and a machine that resolves `auto` differently does the same to
the assets that run a model."""
import ast
import importlib
import shutil
import textwrap
from pathlib import Path

import pytest

from assets.closure import Project
from assets.versions import AREAS, closure, code_version, runs_model, with_code_versions
from resources import PresetResource, TargetResource

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3_platform", "assets", "resources")
TINY, TARGET = PresetResource(name="tiny"), TargetResource(model="tiny-random")
INT4 = "eagle3_platform/model/int4_weights.py"
LOADS_THE_TARGET = {"target_responses", "feature_shards", "deployment", "benchmark_report"}


def versions(root: Path, preset=TINY) -> dict[str, str]:
    return {a: code_version(a, preset, TARGET, root=root) for a in AREAS}


def copy_sources(dest: Path, edit: tuple[str, str, str] | None = None) -> Path:
    """The project's sources under dest, with one (file, old, new) text edit."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        path, old, new = dest / edit[0], edit[1], edit[2]
        assert path.read_text().count(old) == 1, old
        path.write_text(path.read_text().replace(old, new))
    return dest


def test_each_asset_reaches_the_code_it_runs():
    model = {f"eagle3_platform/model/{m}.py" for m in ("target", "compute", "attention", "packed_linear")} | {INT4}
    assert model <= closure("feature_shards")  # load_target's kernels, reached through lazy imports
    assert {"eagle3_platform/features/extract.py", "eagle3_platform/features/capture.py"} <= closure(
        "feature_shards")
    step = {f"eagle3_platform/model/{m}.py" for m in ("forward", "ragged", "sampling")}
    assert model | step | {"eagle3_platform/data/local_gen.py"} <= closure("target_responses")
    assert "eagle3_platform/model/sampling.py" in closure("draft_head")
    for name in ("deployment", "benchmark_report"):  # the server runs as `eagle3 serve`, a program
        assert {"resources/serving.py", "eagle3_platform/serve/server.py", "eagle3_platform/spec/engine.py",
                "eagle3_platform/spec/drafter.py", INT4} <= closure(name)
    assert "eagle3_platform/bench/locustfile.py" in closure("benchmark_report")  # a file it names
    assert "eagle3_platform/bench/locustfile.py" not in closure("deployment")
    # a stage's runner, not the other stages its module defines
    prompts = closure("filtered_prompts")
    assert {f"eagle3_platform/data/{m}.py" for m in ("filter", "pii", "stages")} <= prompts
    assert not {"eagle3_platform/spec/drafter.py", "eagle3_platform/data/local_gen.py",
                "eagle3_platform/model/compute.py", INT4, "resources/serving.py"} & prompts
    assert not {INT4, "eagle3_platform/model/compute.py", "eagle3_platform/draft/ttt.py",
                "eagle3_platform/draft/export.py"} & closure("draft_vocab")  # the head's, in the same module
    assert {a for a in AREAS if INT4 in closure(a)} == LOADS_THE_TARGET
    # an upstream asset is lineage, and the package that lists every asset runs none of them
    assert "assets/prompts.py" not in closure("feature_shards") and "assets/__init__.py" not in prompts
    assert {a for a in AREAS if runs_model(a)} == LOADS_THE_TARGET | {"draft_head"}


def test_the_resources_an_asset_requires_are_in_its_code():
    from assets import ALL_ASSETS
    from resources import build_resources

    resources = build_resources()
    for a in ALL_ASSETS:
        if not materializable(a):
            continue
        (key,) = a.keys
        files = closure(key.to_user_string())
        for rkey in a.required_resource_keys - {"io_manager"}:  # Dagster's own
            module = type(resources[rkey]).__module__
            assert module.replace(".", "/") + ".py" in files, (key, rkey)
    assert "resources/pipes_worker.py" in closure("feature_shards")  # `-m resources.pipes_worker`


def test_the_library_loads_modules_by_name_only_where_the_closure_resolves_it():
    """importlib is called in two dispatchers, whose tables the closure reads as they run."""
    callers = set()
    for path in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__"):
                callers.add(str(path.relative_to(ROOT)))
    assert callers == {"eagle3_platform/stage.py", "eagle3_platform/cli/__init__.py"}
    from eagle3_platform import stage

    project = Project(ROOT)
    for area in stage.AREAS:  # a request class brings its runner: both live in the area's module
        runners = importlib.import_module(area).RUNNERS
        assert all(t.__module__ == f.__module__ == area for t, f in runners.items()), area
        assert project.module(area).pairs == {t.__name__: f.__name__ for t, f in runners.items()}
    from eagle3_platform.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    registered = {c: m for m, commands in project.cli_areas().items() for c in commands}
    for command, parser in sub.choices.items():  # a subcommand's handler is in the area registering it
        assert parser.get_default("func").__module__ == registered[command], command


@pytest.fixture(scope="module")
def int4_change(tmp_path_factory) -> tuple[Path, Path]:
    """Two copies of the sources: as they are, and with the int4 kernel's sum written another way."""
    tmp = tmp_path_factory.mktemp("sources")
    return copy_sources(tmp / "before"), copy_sources(tmp / "after", (INT4, "        out += plane",
                                                                      "        out = out + plane"))


def test_a_change_deep_in_the_library_changes_exactly_its_users_versions(int4_change, tmp_path):
    before, after = int4_change
    old, new = versions(before), versions(after)
    changed = {a for a in AREAS if old[a] != new[a]}
    assert changed == {a for a in AREAS if INT4 in closure(a, after)} == LOADS_THE_TARGET
    assert versions(copy_sources(tmp_path / "elsewhere" / "checkout")) == old  # wherever the checkout lies
    comment = (INT4, "    out = first.float()", "    out = first.float()  # fp32")
    assert versions(copy_sources(tmp_path / "commented", comment)) == old  # a comment is no code change


def test_dagster_reports_exactly_the_changed_assets_stale(int4_change):
    """Materializations recorded at the old versions; Dagster's stale-status resolver over the graph
    at the new ones."""
    from dagster import DagsterInstance, materialize
    from dagster._core.definitions.assets.graph.asset_graph import AssetGraph
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleCauseCategory, StaleStatus
    from dagster._core.loader import LoadingContextForTest

    from assets import ALL_ASSETS

    before, after = int4_change
    built_at = with_code_versions(ALL_ASSETS, TINY, TARGET, root=before)
    parts = partitions(built_at)
    with DagsterInstance.ephemeral() as instance:
        stubs = stand_ins(built_at)
        materialize(stubs, selection=[k for k, p in parts.items() if p], partition_key="code", instance=instance)
        materialize(stubs, selection=[k for k, p in parts.items() if not p], instance=instance)

        def status(assets) -> dict:
            resolver = CachingStaleStatusResolver(instance, AssetGraph.from_assets(assets),
                                                  LoadingContextForTest(instance))
            out = {}
            for key, partitioned in parts.items():
                partition = "code" if partitioned else None
                out[key.to_user_string()] = (resolver.get_status(key, partition),
                                             {c.category for c in resolver.get_stale_causes(key, partition)})
            return out

        assert {s for s, _ in status(built_at).values()} == {StaleStatus.FRESH}
        now = status(with_code_versions(ALL_ASSETS, TINY, TARGET, root=after))
        assert {a for a, (s, _) in now.items() if s == StaleStatus.STALE} == LOADS_THE_TARGET
        assert all(now[a] == (StaleStatus.STALE, {StaleCauseCategory.CODE}) for a in LOADS_THE_TARGET)
        assert all(now[a] == (StaleStatus.FRESH, set()) for a in set(AREAS) - LOADS_THE_TARGET)
        assert set(now) == set(AREAS)  # the observed source has no code version


def partitions(assets) -> dict:
    """Materializable asset key -> whether it is partitioned."""
    return {k: a.partitions_def is not None for a in assets if materializable(a) for k in a.keys}


def materializable(a) -> bool:
    return getattr(a, "is_materializable", False)  # an observable source is a SourceAsset


def stand_ins(assets) -> list:
    """Assets with the same keys, deps, partitions and code versions whose bodies do nothing: what
    Dagster records of a materialization without running the pipeline."""
    from dagster import AssetSpec, MaterializeResult, multi_asset

    def stand_in(spec):
        @multi_asset(specs=[spec], name=f"stand_in_{spec.key.to_python_identifier()}")
        def body():
            return MaterializeResult(asset_key=spec.key)

        return body

    sources = [AssetSpec(a.key, partitions_def=a.partitions_def) for a in assets if not materializable(a)]
    return [stand_in(s) for a in assets if materializable(a) for s in a.specs] + sources


def test_a_machine_resolving_auto_otherwise_changes_the_model_assets_only(monkeypatch):
    from eagle3_platform.model import compute

    here = versions(ROOT)
    resolve = compute.resolve_dtype

    def elsewhere(name, device="cpu", work="decode"):
        got = resolve(name, device, work)
        return {"bfloat16": "float32", "float32": "bfloat16"}[got] if name == "auto" else got

    pinned = PresetResource(name="tiny", dtype="float32")
    pinned_here = versions(ROOT, pinned)
    monkeypatch.setattr(compute, "resolve_dtype", elsewhere)
    there = versions(ROOT)
    assert {a for a in AREAS if here[a] != there[a]} == {a for a in AREAS if runs_model(a)} != set(AREAS)
    assert versions(ROOT, pinned) == pinned_here  # a pinned dtype does not read the machine


TOY = {  # a small project: what reaches what is known by construction
    "eagle3_platform/__init__.py": "",
    "eagle3_platform/lib.py": '''
        """Doc."""
        from eagle3_platform.util import helper

        NAMES = []
        NAMES.append("x")  # acts on import


        def used():
            from .lazy import deep
            run("script.py")
            return deep() + helper()


        def unused():
            from eagle3_platform.heavy import big
            return big()
        ''',
    "eagle3_platform/util.py": "def helper():\n    return 1\n\n\ndef other():\n    return 2\n",
    "eagle3_platform/lazy.py": "def deep():\n    return 2\n",
    "eagle3_platform/heavy.py": "def big():\n    return 3\n",
    "eagle3_platform/pkg/__init__.py": "from eagle3_platform.pkg.impl import Thing\n",
    "eagle3_platform/pkg/impl.py": '''
        class Thing:
            def run(self):
                from eagle3_platform.via_class import f
                return f()
        ''',
    "eagle3_platform/via_class.py": "def f():\n    return 4\n",
    "eagle3_platform/script.py": "print(6)\n",  # a file named beside its module
    "eagle3_platform/named.py": "def g():\n    return 7\n",  # a module named by a dotted string
    "eagle3_platform/prog.py": "def main():\n    return 5\n\n\nif __name__ == '__main__':\n    main()\n",
    "eagle3_platform/tool/__init__.py": "def main():\n    return 8\n",  # a package run as a program
    "eagle3_platform/tool/__main__.py": "from eagle3_platform.tool import main\n\nif __name__ == '__main__':\n    main()\n",
    "assets/__init__.py": "from assets.a import first, second\n",
    "assets/a.py": '''
        from dagster import asset

        from eagle3_platform import lib
        from eagle3_platform.pkg import Thing


        @asset
        def first():
            return lib.used() + Thing().run()


        @asset(deps=[first])
        def second():
            import subprocess
            import sys
            subprocess.run([sys.executable, "-m", "eagle3_platform.prog"])
            subprocess.run([sys.executable, "-m", "eagle3_platform.tool"])
            return "eagle3_platform.named"
        ''',
}


@pytest.fixture()
def toy(tmp_path) -> Path:
    for rel, text in TOY.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text).lstrip())
    return tmp_path


def test_the_closure_follows_names_through_lazy_relative_and_package_imports(toy):
    p = Project(toy)
    assert set(p.assets) == {"first", "second"}
    assert p.files("first") == {"assets/a.py", "eagle3_platform/lib.py", "eagle3_platform/util.py",
                                "eagle3_platform/lazy.py", "eagle3_platform/pkg/__init__.py",
                                "eagle3_platform/pkg/impl.py", "eagle3_platform/via_class.py",
                                "eagle3_platform/script.py"}
    # `first` in its decorator is lineage; the programs it runs (a package's __main__.py too) and the
    # module it names count
    assert p.files("second") == {"assets/a.py", "eagle3_platform/prog.py", "eagle3_platform/named.py",
                                 "eagle3_platform/tool/__init__.py", "eagle3_platform/tool/__main__.py"}


@pytest.mark.parametrize("path,old,new,changes", [
    ("eagle3_platform/lazy.py", "return 2", "return 20", True),            # deep, behind a lazy import
    ("eagle3_platform/lib.py", '"x"', '"y"', True),                          # what the module does on import
    ("eagle3_platform/via_class.py", "return 4", "return 40", True),       # behind a method's import
    ("eagle3_platform/heavy.py", "return 3", "return 30", False),          # only an unused function imports it
    ("eagle3_platform/util.py", "return 2", "return 20", False),           # a function nothing calls
    ("eagle3_platform/lib.py", '"""Doc."""', '"""Other doc."""', False),  # docs and comments
    ("eagle3_platform/lib.py", "# acts on import", "# runs on import", False),
])
def test_what_changes_the_source_hash(toy, path, old, new, changes):
    before = Project(toy).source_hash("first")
    (toy / path).write_text((toy / path).read_text().replace(old, new))
    assert (Project(toy).source_hash("first") != before) == changes
