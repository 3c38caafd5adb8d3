"""Partitioned materialization through Dagster on the tiny target with local storage:
workload_sources → filtered_prompts → target_responses (→ feature_shards, whose blocking shard check
runs in the same step)."""
import pytest
from dagster import AssetKey, DagsterInstance

from resources import StorageResource
from dagster_helpers import check_prompts_and_responses, meta, run, tiny_resources

WORKLOAD = "code"


@pytest.fixture()
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_partition_materializes_prompts_responses_features(tmp_path, tiny_target_dir, instance):
    storage = StorageResource(root=str(tmp_path / "data"))
    res = tiny_resources(storage, tiny_target_dir)
    result = run(["filtered_prompts", "target_responses", "feature_shards"], res, instance, WORKLOAD)
    assert result.success
    check_prompts_and_responses(storage, result, WORKLOAD)
    fs = meta(result, "feature_shards")
    assert fs["samples"] + fs["rejected"] == fs["read"]
    assert storage.exists(f"{WORKLOAD}/features/train/manifest.parquet")
    assert fs["target_id"] == "tiny-random" and fs["template_hash"]
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "shards_verify" and check.passed
    # only the requested partition was built
    assert not storage.exists("chat/filtered_prompts/train/kept.jsonl")
    leftovers = [p for p in (tmp_path / "data" / ".staging").rglob("*") if p.is_file()]
    assert not leftovers  # staging cleaned after publishing
    mats = instance.fetch_materializations(AssetKey("target_responses"), limit=5).records
    assert [m.partition_key for m in mats] == [WORKLOAD]


def test_corrupt_stored_shard_fails_the_blocking_check(tmp_path, tiny_target_dir, instance, monkeypatch):
    """The check re-reads what was stored: a shard damaged after publishing is named, not used."""
    import assets.features as F

    storage = StorageResource(root=str(tmp_path / "data"))
    res = tiny_resources(storage, tiny_target_dir)
    publish = type(storage).publish_from

    def publish_then_corrupt(self, src, key):
        uri = publish(self, src, key)
        if key.endswith("features/train"):
            shard = sorted(self.local_path(key).glob("shard-*.safetensors"))[0]
            shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
        return uri

    monkeypatch.setattr(type(storage), "publish_from", publish_then_corrupt)
    run(["filtered_prompts", "target_responses"], res, instance, WORKLOAD)
    from dagster import materialize
    from dagster_helpers import GRAPH

    result = materialize(GRAPH, selection=["feature_shards"], partition_key=WORKLOAD, instance=instance,
                         resources=res, raise_on_error=False)
    evals = result.get_asset_check_evaluations()
    assert evals and not evals[0].passed
    assert "shard-00000" in str(evals[0].metadata["first_problems"].value)
    assert F  # module imported: the check lives beside the asset


@pytest.mark.integration
def test_pipes_compute_mode_matches_in_process(tmp_path, tiny_target_dir, instance):
    """compute=pipes runs each step as its `eagle3` CLI command in a child process (Dagster Pipes);
    it must produce the same artifacts as the in-process library call."""
    outs = {}
    for mode in ("in_process", "pipes"):
        storage = StorageResource(root=str(tmp_path / mode))
        result = run(["filtered_prompts"], tiny_resources(storage, tiny_target_dir, compute=mode), instance,
                     WORKLOAD)
        m = meta(result, "filtered_prompts")
        assert m["kept"] + m["rejected"] == m["read"]
        outs[mode] = (storage.fetch(f"{WORKLOAD}/filtered_prompts/train/kept.jsonl").read_text(),
                      storage.fetch(f"{WORKLOAD}/filtered_prompts/train/rejected.jsonl").read_text(), m["read"])
    assert outs["pipes"] == outs["in_process"]
