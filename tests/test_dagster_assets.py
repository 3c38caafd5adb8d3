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


TIMINGS = ("train_tokens_per_s",)  # wall-clock facts in the training metrics: the only allowed difference


def stored_files(root) -> dict[str, bytes]:
    """Every stored artifact under a local storage root (staging excluded), by relative path; the root
    itself (recorded in provenance fields) replaced by ROOT, timings dropped."""
    import json
    from pathlib import Path

    root, out = Path(root), {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".staging" not in p.parts:
            data = p.read_bytes().replace(str(root).encode(), b"ROOT")
            if p.name == "metrics.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k not in TIMINGS}).encode()
            out[str(p.relative_to(root))] = data
    return out


@pytest.mark.integration
def test_pipes_compute_mode_matches_in_process(tmp_path, tiny_target_dir, instance):
    """compute=pipes ships each stage's request to a Pipes worker in a child process, which calls the
    same `eagle3_platform.stage.run`: the tiny pipeline (prompts → responses → features → vocab → head
    + export) must store byte-identical artifacts in both modes."""
    files = {}
    for mode in ("in_process", "pipes"):
        storage = StorageResource(root=str(tmp_path / mode))
        res = tiny_resources(storage, tiny_target_dir, compute=mode)
        result = run(["filtered_prompts", "target_responses", "feature_shards"], res, instance, WORKLOAD)
        check_prompts_and_responses(storage, result, WORKLOAD)
        head = run(["draft_vocab", "draft_head"], res, instance)
        assert meta(head, "draft_head")["train_simulated_acceptance"] >= 1.0
        files[mode] = stored_files(tmp_path / mode)
    assert {"code/filtered_prompts/train/kept.jsonl", "code/target_responses/train/conversations.jsonl",
            "code/features/train/manifest.parquet", "draft/vocab/vocab.safetensors",
            "draft/export/model.safetensors"} <= set(files["in_process"])
    assert sorted(files["pipes"]) == sorted(files["in_process"])
    differ = [k for k in files["in_process"] if files["pipes"][k] != files["in_process"][k]]
    assert not differ, differ
