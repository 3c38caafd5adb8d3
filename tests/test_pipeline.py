"""`eagle3 run` (pipeline.py) asks Dagster what to build: the plan follows the asset graph, and a step
runs only when the instance's records say an asset is missing or stale."""
import pytest
from dagster import AssetKey, AssetMaterialization, AssetObservation, DagsterInstance, MetadataValue

import pipeline
from resources import StorageResource


@pytest.fixture(scope="module")
def graph():
    from definitions import build_definitions

    return build_definitions(preset="tiny", target="tiny-random").resolve_asset_graph()


@pytest.fixture()
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_plan_follows_the_asset_graph(graph):
    steps = pipeline.plan(graph, "draft_head", ["code", "chat"])
    assert [name for name, _, _ in steps] == ["partition:code", "partition:chat", "draft_vocab", "draft_head"]
    assert [k.to_user_string() for k in steps[0][1]] == ["filtered_prompts", "target_responses", "feature_shards"]
    assert [name for name, _, _ in pipeline.plan(graph, "target_responses", ["math"])] == ["partition:math"]
    with pytest.raises(ValueError, match="--through 'nope'"):
        pipeline.plan(graph, "nope", ["code"])


def built(instance, graph, name, partition=None, **metadata):
    key = AssetKey(name)
    instance.report_runless_asset_event(AssetMaterialization(
        name, partition=partition, metadata=metadata,
        tags={"dagster/code_version": graph.get(key).code_version}))


def observed(instance, workload, version):
    instance.report_runless_asset_event(AssetObservation(
        "workload_sources", partition=workload, tags={"dagster/data_version": version}))


def test_missing_or_stale_from_the_instance_records(graph, instance, tmp_path):
    storage = StorageResource(root=str(tmp_path))
    prompts, responses = AssetKey("filtered_prompts"), AssetKey("target_responses")

    def reason(key):
        return pipeline.stale_reason(instance, graph, storage, key, "code")

    observed(instance, "code", "v1")
    assert reason(prompts) == "missing"
    kept = tmp_path / "code" / "kept.jsonl"
    kept.parent.mkdir()
    kept.write_text("{}\n")
    built(instance, graph, "filtered_prompts", "code", kept_uri=MetadataValue.path(storage.uri("code/kept.jsonl")))
    built(instance, graph, "target_responses", "code")
    assert reason(prompts) is None and reason(responses) is None
    observed(instance, "code", "v1")  # observed again, same data: still current
    assert reason(prompts) is None

    observed(instance, "code", "v2")
    assert reason(prompts) == "workload_sources data version changed"
    built(instance, graph, "filtered_prompts", "code", kept_uri=MetadataValue.path(storage.uri("code/kept.jsonl")))
    assert reason(prompts) is None
    assert reason(responses) == "filtered_prompts materialized since"

    kept.unlink()  # the stored output is gone although Dagster recorded it
    assert reason(prompts).startswith("output gone")
    instance.report_runless_asset_event(AssetMaterialization(
        "target_responses", partition="code", tags={"dagster/code_version": "older"}))
    assert reason(responses) == "code or settings changed"


def test_the_regeneration_budget_flag_reaches_the_pipeline_and_a_negative_one_is_refused(capsys):
    import argparse

    from eagle3_platform.run_cli import pipeline_command

    a = argparse.Namespace(preset="cpu", force=False, regen_budget_min=2.5)
    cmd = pipeline_command(a)
    assert cmd[cmd.index("--regen-budget-min") + 1] == "2.5"
    assert pipeline.parse_args(cmd[cmd.index("--preset"):]).regen_budget_min == 2.5
    with pytest.raises(SystemExit):
        pipeline.parse_args(["--regen-budget-min", "-1"])
    assert "minutes must be >= 0" in capsys.readouterr().err


def test_the_prompts_per_workload_flag_reaches_the_preset_resource_and_scales_long_context(capsys):
    import argparse

    from eagle3_platform.run_cli import pipeline_command
    from resources import PresetResource

    a = argparse.Namespace(preset="cpu", force=False, prompts_per_workload=1600)
    cmd = pipeline_command(a)
    assert pipeline.parse_args(cmd[cmd.index("--preset"):]).prompts_per_workload == 1600
    sources = PresetResource(name="cpu", prompts_per_workload=1600).config().sources
    assert (sources.train_limit("chat"), sources.train_limit("long_context")) == (1600, 256)  # cpu: 64 per 400
    assert PresetResource(name="demo", prompts_per_workload=80).config().sources.train_limit("long_context") == 80
    assert PresetResource(name="cpu").config().sources.train_limit("chat") == 400
    with pytest.raises(SystemExit):
        pipeline.parse_args(["--prompts-per-workload", "0"])
    assert "must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be >= 1"):
        PresetResource(name="cpu", prompts_per_workload=0).config()


@pytest.mark.parametrize("force", [False, True])
def test_force_tags_its_runs_as_rebuilds_so_nothing_published_is_continued(instance, monkeypatch, force):
    import dagster

    from assets.responses import REBUILD_TAG
    from definitions import build_definitions

    class Launched(Exception):
        pass

    tags = {}

    def launch(*args, **kwargs):
        tags.update(kwargs["tags"])
        raise Launched

    monkeypatch.setattr(dagster, "materialize", launch)
    defs = build_definitions(preset="tiny", target="tiny-random")
    graph = defs.resolve_asset_graph()
    name, keys, partition = pipeline.plan(graph, "target_responses", ["code"])[0]
    with pytest.raises(Launched):  # missing, so launched either way
        pipeline._step(instance, defs, graph, name, keys, partition, force)
    assert tags.get(REBUILD_TAG) == ("true" if force else None)


def test_a_step_stopped_by_a_signal_is_reported_as_interrupted_and_resumable():
    from types import SimpleNamespace

    from dagster._utils.error import SerializableErrorInfo

    def failed(err):
        return SimpleNamespace(all_events=[SimpleNamespace(
            is_step_failure=True, step_key="target_responses", step_failure_data=SimpleNamespace(error=err))])

    stopped = SerializableErrorInfo("", [], "DagsterExecutionInterruptedError")
    assert pipeline._failure(failed(stopped)) == ("target_responses: interrupted (a signal stopped it); rerun "
                                                  "the same command to go on where it stopped")
    wrapped = SerializableErrorInfo("step failed", [], "DagsterExecutionStepExecutionError",
                                    cause=SerializableErrorInfo("0 of 8 records written\n", [], "ValueError"))
    assert pipeline._failure(failed(wrapped)) == "target_responses: 0 of 8 records written"
