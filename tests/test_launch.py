"""`eagle3 run` (assets/launch.py) asks Dagster what to build: the plan follows the asset graph, a step
runs what Dagster's stale-status resolver reports missing or stale (or whose stored output is gone),
and each step is a run of the named job that holds its assets, in the instance the UI reads.

Staleness is tested on stand-ins: the real graph's asset names, partitioning and jobs, with bodies
that write one small file, materialized for real (so Dagster records its own provenance)."""
import hashlib
import json
from types import SimpleNamespace

import pytest
from dagster import (AssetKey, DagsterInstance, DataVersion, DataVersionsByPartition, Definitions,
                     MaterializeResult, StaticPartitionsDefinition, asset, observable_source_asset)

from assets import launch
from assets.jobs import PARTITIONED, draft_job, observe_job, serve_job, workload_job
from assets.metadata import REBUILD_TAG, location
from resources import StorageResource

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")  # observable sources are beta


@pytest.fixture(scope="module")
def graph():
    from definitions import build_definitions

    return build_definitions(preset="tiny", target="tiny-random").resolve_asset_graph()


@pytest.fixture()
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_plan_follows_the_asset_graph(graph):
    steps = launch.plan(graph, "draft_head", ["code", "chat"])
    assert [name for name, _, _ in steps] == ["partition:code", "partition:chat", "draft_vocab", "draft_head"]
    assert [k.to_user_string() for k in steps[0][1]] == ["filtered_prompts", "target_responses", "feature_shards"]
    assert [name for name, _, _ in launch.plan(graph, "target_responses", ["math"])] == ["partition:math"]
    with pytest.raises(ValueError, match="--through 'nope'"):
        launch.plan(graph, "nope", ["code"])


# ---- stand-ins ---------------------------------------------------------------------------------------
CHAIN = [("filtered_prompts", "workload_sources"), ("target_responses", "filtered_prompts"),
         ("feature_shards", "target_responses"), ("draft_vocab", "feature_shards"), ("draft_head", "draft_vocab"),
         ("deployment", "draft_head"), ("benchmark_report", "deployment")]


def standins(root, source: dict, versions=None) -> Definitions:
    """The real graph's shape on two workloads; `source` holds each workload's content (mutable)."""
    parts = StaticPartitionsDefinition(sorted(source))

    @observable_source_asset(name="workload_sources", partitions_def=parts)
    def workload_sources():
        return DataVersionsByPartition({w: DataVersion(v) for w, v in source.items()})

    def standin(name: str, dep: str):
        partitioned = name in PARTITIONED

        @asset(name=name, deps=[dep], partitions_def=parts if partitioned else None,
               code_version=(versions or {}).get(name, "1"))
        def body(context, storage: StorageResource) -> MaterializeResult:
            key = f"{name}/{context.partition_key if partitioned else 'all'}"
            text = f"{name} of {source[context.partition_key]}" if name == "filtered_prompts" else name
            storage.local_path(key).parent.mkdir(parents=True, exist_ok=True)
            storage.local_path(key).write_text(text)
            # as the real prompts do: their data version names what they hold
            version = DataVersion(hashlib.sha256(text.encode()).hexdigest()) if name == "filtered_prompts" else None
            return MaterializeResult(metadata={"out_uri": location(storage.uri(key))}, data_version=version)

        return body

    return Definitions(assets=[workload_sources, *(standin(n, d) for n, d in CHAIN)],
                       jobs=[observe_job, workload_job, draft_job, serve_job],
                       resources={"storage": StorageResource(root=str(root))})


def keys(*names):
    return [AssetKey(n) for n in names]


def run_step(instance, defs, name, force=False, tags=None):
    partition = name.split(":")[1] if name.startswith("partition:") else None
    step_keys = keys(*PARTITIONED) if partition else keys(name)
    return launch.step(instance, defs, name, step_keys, partition, force, tags or {})


def reason(instance, defs, name, partition="code"):
    resolver = launch.stale_resolver(instance, defs.resolve_asset_graph())
    return launch.rebuild_reason(resolver, instance, defs.resources["storage"], AssetKey(name), partition)


def test_missing_or_stale_as_dagster_reports_it(instance, tmp_path):
    source = {"code": "v1", "chat": "v1"}
    defs = standins(tmp_path, source)
    assert launch.launch(instance, defs, "observe_workload_sources").success
    assert reason(instance, defs, "filtered_prompts") == "missing"
    run_step(instance, defs, "partition:code")
    run_step(instance, defs, "draft_vocab")
    assert all(reason(instance, defs, n) is None for n in PARTITIONED)
    assert reason(instance, defs, "draft_vocab", None) is None
    launch.launch(instance, defs, "observe_workload_sources")  # observed again, same data: still current
    assert reason(instance, defs, "filtered_prompts") is None

    source["code"] = "v2"
    launch.launch(instance, defs, "observe_workload_sources")
    assert reason(instance, defs, "filtered_prompts") == "has a new dependency data version (workload_sources[code])"
    assert reason(instance, defs, "filtered_prompts", "chat") == "missing"
    launch.launch(instance, defs, "workload_refresh", keys("filtered_prompts"), "code")  # new prompts
    assert reason(instance, defs, "filtered_prompts") is None
    assert reason(instance, defs, "target_responses") == "has a new dependency data version (filtered_prompts[code])"
    run_step(instance, defs, "partition:code")
    assert reason(instance, defs, "draft_vocab", None) == "has a new dependency data version (feature_shards[code])"

    (tmp_path / "filtered_prompts" / "code").unlink()  # the stored output is gone although Dagster recorded it
    assert reason(instance, defs, "filtered_prompts") == f"output gone: {tmp_path / 'filtered_prompts' / 'code'}"
    changed = standins(tmp_path, source, versions={"feature_shards": "2"})
    assert reason(instance, changed, "feature_shards") == "has a new code version"
    assert reason(instance, changed, "feature_shards", "chat") == "missing"


def test_a_recorded_location_is_checked_in_either_form(tmp_path):
    """Metadata records a local output as a path; materializations made before recorded a file:// URI."""
    storage = StorageResource(root=str(tmp_path / "data dir"))
    kept = tmp_path / "data dir" / "code" / "kept.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}\n")
    for recorded in (str(kept), storage.uri("code/kept.jsonl")):
        assert launch._stored(storage, recorded), recorded
    kept.unlink()
    for recorded in (str(kept), storage.uri("code/kept.jsonl")):
        assert not launch._stored(storage, recorded), recorded
    assert launch._stored(storage, "gs://elsewhere/x")  # not in this storage: nothing to check


def test_a_step_is_a_run_of_its_named_job_from_the_first_stale_asset_on(instance, tmp_path):
    defs = standins(tmp_path, {"code": "v1", "chat": "v1"})
    tags = {"eagle3/preset": "tiny", "eagle3/target": "tiny-random@abc"}
    launch.launch(instance, defs, "observe_workload_sources", tags=tags)
    assert run_step(instance, defs, "partition:code", tags=tags)["materialized"] == list(PARTITIONED)
    (tmp_path / "target_responses" / "code").unlink()
    assert run_step(instance, defs, "partition:code", tags=tags)["materialized"] == ["target_responses",
                                                                                   "feature_shards"]
    assert run_step(instance, defs, "partition:code", tags=tags) == {"step": "partition:code", "skipped": True}
    for name in ("draft_vocab", "draft_head", "deployment"):
        run_step(instance, defs, name, tags=tags)

    runs = {r.job_name: r for r in reversed(instance.get_runs())}  # the latest run of each job
    assert set(runs) == {"observe_workload_sources", "workload_refresh", "draft_retrain", "deploy_and_benchmark"}
    refresh = runs["workload_refresh"]
    assert refresh.asset_selection == set(keys("target_responses", "feature_shards"))
    assert refresh.tags["dagster/partition"] == "code"
    assert {k: refresh.tags[k] for k in tags} == tags and refresh.tags["eagle3/launched_by"] == "eagle3 run"
    # the run belongs to the code location the UI loads, so the UI can re-execute it and shows it on the timeline
    origin = refresh.remote_job_origin
    assert (origin.job_name, origin.location_name, origin.repository_origin.repository_name) == (
        "workload_refresh", "definitions", "__repository__")
    head = instance.fetch_materializations(AssetKey("draft_head"), limit=1).records[0]
    assert runs["deploy_and_benchmark"].tags["eagle3/head"] == head.asset_materialization.tags["dagster/data_version"]
    assert "eagle3/head" not in runs["draft_retrain"].tags


@pytest.mark.parametrize("force", [False, True])
def test_force_tags_its_runs_as_rebuilds_so_nothing_published_is_continued(instance, tmp_path, force):
    defs = standins(tmp_path, {"code": "v1", "chat": "v1"})
    launch.launch(instance, defs, "observe_workload_sources")
    run_step(instance, defs, "partition:code")
    done = run_step(instance, defs, "partition:code", force=force)  # up to date: rebuilt only when forced
    assert done.get("materialized") == (list(PARTITIONED) if force else None)
    latest = instance.get_runs(limit=1)[0]
    assert latest.tags.get(REBUILD_TAG) == ("true" if force else None)


# ---- the flags: declared once, in the library --------------------------------------------------------
def parse(*argv):
    from eagle3_platform.cli import build_parser

    return build_parser().parse_args(["run", *argv])


def test_the_flags_reach_the_launcher_as_parsed():
    from pathlib import Path

    from eagle3_platform.cli.run import launch_command

    cmd = launch_command(parse("--preset", "cpu", "--target", "tiny-random", "--workloads", "code,math",
                               "--regen-budget-min", "2.5", "--prompts-per-workload", "1600", "--force"))
    assert cmd[1:3] == ["-m", "assets.launch"] and len(cmd) == 4  # one argument: the parsed flags
    a = SimpleNamespace(**json.loads(cmd[3]))
    assert (a.preset, a.workloads, a.through, a.force) == ("cpu", ["code", "math"], "benchmark_report", True)
    preset = launch.definitions_for(a).resources["preset"]
    assert (preset.name, preset.regen_time_budget_s, preset.prompts_per_workload) == ("cpu", 150, 1600)
    assert "argparse" not in Path(launch.__file__).read_text()  # the launcher declares no flag of its own


@pytest.mark.parametrize("argv, message", [
    (["--regen-budget-min", "-1"], "minutes must be >= 0"),
    (["--regen-budget-min", "nan"], "minutes must be >= 0"),
    (["--prompts-per-workload", "0"], "--prompts-per-workload 0: must be >= 1"),
    (["--workloads", "code,nope"], "unknown workloads ['nope']")])
def test_bad_flags_are_refused_before_anything_runs(capsys, monkeypatch, argv, message):
    from eagle3_platform import cli
    from eagle3_platform.cli import run as run_cli

    monkeypatch.setattr(run_cli, "run_with_summary", lambda *a, **k: pytest.fail("the launcher was started"))
    assert cli.main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_prompts_per_workload_flag_reaches_the_preset_resource_and_scales_long_context():
    from resources import PresetResource

    sources = PresetResource(name="cpu", prompts_per_workload=1600).config().sources
    assert (sources.train_limit("chat"), sources.train_limit("long_context")) == (1600, 256)  # cpu: 64 per 400
    assert PresetResource(name="demo", prompts_per_workload=80).config().sources.train_limit("long_context") == 80
    assert PresetResource(name="cpu").config().sources.train_limit("chat") == 400
    with pytest.raises(ValueError, match="must be >= 1"):
        PresetResource(name="cpu", prompts_per_workload=0).config()


def test_a_step_stopped_by_a_signal_is_reported_as_interrupted_and_resumable():
    from dagster._utils.error import SerializableErrorInfo

    def failed(err):
        return SimpleNamespace(all_events=[SimpleNamespace(
            is_step_failure=True, step_key="target_responses", step_failure_data=SimpleNamespace(error=err))])

    stopped = SerializableErrorInfo("", [], "DagsterExecutionInterruptedError")
    assert launch._failure(failed(stopped)) == ("target_responses: interrupted (a signal stopped it); rerun "
                                                "the same command to go on where it stopped")
    wrapped = SerializableErrorInfo("step failed", [], "DagsterExecutionStepExecutionError",
                                    cause=SerializableErrorInfo("0 of 8 records written\n", [], "ValueError"))
    assert launch._failure(failed(wrapped)) == "target_responses: 0 of 8 records written"
