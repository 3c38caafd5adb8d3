"""GCS storage through the Dagster storage resource, against a local GCS emulator (gcp-storage-emulator,
in-process on 127.0.0.1; anonymous credentials; nothing leaves loopback)."""
import os
import socket

import pytest

BUCKET = "eagle3-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs_emulator():
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    old = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def gcs_resource(gcs_emulator, tmp_path, request):
    from resources import StorageResource

    return StorageResource(root=f"gs://{BUCKET}/t/{request.node.name}", work_dir=str(tmp_path / "work"))


def test_gcs_resource_round_trip(gcs_resource, tmp_path):
    res = gcs_resource
    stage = res.staging("chat/features/train", "abc")
    (stage / "manifest.parquet").write_bytes(b"m")
    (stage / "shard-00000.safetensors").write_bytes(b"x" * 100)
    uri = res.publish_from(stage, "chat/features/train")
    assert uri == f"gs://{BUCKET}/t/test_gcs_resource_round_trip/chat/features/train"
    assert not stage.exists()  # staging dropped after publishing
    assert res.list("chat/features/train") == ["chat/features/train/manifest.parquet",
                                               "chat/features/train/shard-00000.safetensors"]
    # The local copy is a cache: a stale extra file there does not survive a fetch.
    local = res.local_path("chat/features/train")
    local.mkdir(parents=True, exist_ok=True)
    (local / "stale.safetensors").write_bytes(b"old")
    got = res.fetch_dir("chat/features/train")
    assert sorted(p.name for p in got.iterdir()) == ["manifest.parquet", "shard-00000.safetensors"]
    assert (got / "shard-00000.safetensors").read_bytes() == b"x" * 100


def test_gcs_missing_key_is_a_clear_error(gcs_resource):
    with pytest.raises(FileNotFoundError, match="materialize its upstream"):
        gcs_resource.fetch("nope/filtered_prompts/train/kept.jsonl")
    with pytest.raises(FileNotFoundError, match="materialize its upstream"):
        gcs_resource.fetch_dir("nope/features/train")


def test_gcs_file_publish_and_fetch(gcs_resource):
    stage = gcs_resource.staging("code/filtered_prompts/train/kept.jsonl", "run1")
    (stage / "kept.jsonl").write_text('{"id": "a"}\n')
    (stage / "rejected.jsonl").write_text("")
    gcs_resource.publish_from(stage / "kept.jsonl", "code/filtered_prompts/train/kept.jsonl")
    assert stage.exists()  # a sibling still staged keeps the directory
    gcs_resource.publish_from(stage / "rejected.jsonl", "code/filtered_prompts/train/rejected.jsonl")
    assert not stage.exists()
    assert gcs_resource.fetch("code/filtered_prompts/train/kept.jsonl").read_text() == '{"id": "a"}\n'
    assert gcs_resource.exists("code/filtered_prompts/train/rejected.jsonl")


def test_partition_materializes_against_gcs(gcs_resource, tiny_target_dir):
    """Same assets, same code path, GCS storage: artifacts land in the bucket, metadata shows gs:// URIs."""
    from dagster import DagsterInstance

    from dagster_helpers import check_prompts_and_responses, meta, run, tiny_resources

    res = tiny_resources(gcs_resource, tiny_target_dir)
    with DagsterInstance.ephemeral() as instance:
        result = run(["filtered_prompts", "target_responses"], res, instance, "code")
    check_prompts_and_responses(gcs_resource, result, "code")
    assert meta(result, "filtered_prompts")["kept_uri"].startswith(f"gs://{BUCKET}/")
    assert meta(result, "target_responses")["conversations_uri"].startswith(f"gs://{BUCKET}/")
    keys = gcs_resource.list("code")
    assert "code/target_responses/train/conversations.jsonl" in keys
    assert "code/filtered_prompts/eval/kept.jsonl" in keys
