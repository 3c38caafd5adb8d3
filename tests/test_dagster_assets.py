"""Partitioned materialization through Dagster on the tiny target with local storage:
workload_sources → filtered_prompts → target_responses (→ feature_shards, whose blocking shard check
runs in the same step)."""
import math
import re

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
STAGING_KEY = re.compile(rb"(\.staging/[\w./-]+?/)[0-9a-f]{16}")  # a step's scratch dir: its input hash


def stored_files(root) -> dict[str, bytes]:
    """Every stored artifact under a local storage root (staging excluded), by relative path; the root
    itself (recorded in provenance fields) replaced by ROOT, staging keys by KEY, timings dropped."""
    import json
    from pathlib import Path

    root, out = Path(root), {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".staging" not in p.parts:
            data = p.read_bytes()
            if p.suffix not in (".safetensors", ".parquet"):  # binary formats stay parseable
                data = STAGING_KEY.sub(rb"\1KEY", data.replace(str(root).encode(), b"ROOT"))
            if p.name == "metrics.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k not in TIMINGS}).encode()
            out[str(p.relative_to(root))] = data
    return out


def _drop_key(value, key: str):
    """`value` with `key` removed from every dict inside it."""
    if isinstance(value, dict):
        return {k: _drop_key(v, key) for k, v in value.items() if k != key}
    if isinstance(value, list):
        return [_drop_key(v, key) for v in value]
    return value


def same_artifact(name: str, a: bytes, b: bytes) -> bool:
    """Byte-equal, or for float artifacts equal within rounding. fp32 kernels in two processes may
    sum in another order (oneDNN picks its path by, among others, buffer alignment), so features,
    weights and metrics are compared with tolerances; a shard's checksum in the manifest follows its
    bytes and is left out, and so is the checkpoint's digest of those checksums (`data_sha256`).
    Everything else (records, vocab, headers, shapes) must match exactly."""
    import io
    import json

    import polars as pl
    import torch
    from safetensors.torch import load

    if a == b:
        return True
    if name.endswith(".safetensors"):
        ta, tb = load(a), load(b)
        # a bf16 tensor (stored features) may differ by one bf16 step where the fp32 value it was
        # rounded from moved by an ulp (another thread count: the Pipes worker is another process)
        rtol = {torch.bfloat16: 2 ** -7}
        return ta.keys() == tb.keys() and _header(a) == _header(b) and all(
            ta[k].dtype == tb[k].dtype
            and torch.allclose(ta[k].float(), tb[k].float(), rtol=rtol.get(ta[k].dtype, 1e-3), atol=1e-4)
            for k in ta)
    if name.endswith(".parquet"):
        fa, fb = (pl.read_parquet(io.BytesIO(x)).drop("sha256", strict=False) for x in (a, b))
        return fa.equals(fb)
    if name.endswith(".json"):
        return _close(*(_drop_key(json.loads(x), "data_sha256") for x in (a, b)))
    return False


def _header(blob: bytes) -> dict:
    import json
    import struct

    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]).get("__metadata__", {})


def _close(x, y) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(u, v) for u, v in zip(x, y))
    if isinstance(x, float) or isinstance(y, float):
        return isinstance(x, (int, float)) and isinstance(y, (int, float)) and math.isclose(x, y, rel_tol=1e-3,
                                                                                          abs_tol=1e-4)
    return x == y


@pytest.mark.integration
def test_pipes_compute_mode_matches_in_process(tmp_path, tiny_target_dir, instance):
    """compute=pipes ships each stage's request to a Pipes worker in a child process, which calls the
    same `eagle3_platform.stage.run`: the tiny pipeline (prompts → responses → features → vocab → head
    + export) must store the same artifacts in both modes (float ones within rounding)."""
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
    differ = [k for k in files["in_process"] if not same_artifact(k, files["pipes"][k], files["in_process"][k])]
    assert not differ, differ


def test_artifact_comparison_allows_rounding_and_nothing_else():
    import io

    import polars as pl
    import torch
    from safetensors.torch import save

    x = torch.randn(4, 8)
    st = lambda t, meta=None: save({"x": t}, metadata=meta or {"dtype": "float32"})  # noqa: E731
    assert same_artifact("a.safetensors", st(x), st(x + 1e-6))
    assert not same_artifact("a.safetensors", st(x), st(x + 0.1))
    assert not same_artifact("a.safetensors", st(x), st(x, {"dtype": "bfloat16"}))
    b = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)  # one bf16 step up: a rounding flip, not more
    assert same_artifact("b.safetensors", st(b), st(b + torch.tensor([2 ** -7, 2 ** -6], dtype=torch.bfloat16)))
    assert not same_artifact("b.safetensors", st(b), st(b * 1.05))

    def pq(sha, samples):
        buf = io.BytesIO()
        pl.DataFrame({"shard": ["s0"], "samples": [samples], "sha256": [sha]}).write_parquet(buf)
        return buf.getvalue()
    assert same_artifact("m.parquet", pq("aa", 2), pq("bb", 2))
    assert not same_artifact("m.parquet", pq("aa", 2), pq("aa", 3))
    assert same_artifact("m.json", b'{"acc": [0.5, 1], "n": 3}', b'{"acc": [0.50001, 1], "n": 3}')
    assert not same_artifact("m.json", b'{"acc": [0.5], "n": 3}', b'{"acc": [0.6], "n": 3}')
    assert not same_artifact("m.json", b'{"id": "a"}', b'{"id": "b"}')
    assert not same_artifact("c.jsonl", b'{"x": 1.0}\n', b'{"x": 1.00001}\n')  # records: exact
    assert STAGING_KEY.sub(rb"\1KEY", b"ROOT/.staging/draft/checkpoint/0123456789abcdef/x") == \
        b"ROOT/.staging/draft/checkpoint/KEY/x"


def test_a_regeneration_budget_override_reaches_the_stage_and_a_raised_one_takes_up_what_it_deferred(
        tmp_path, tiny_target_dir, instance):
    """`--regen-budget-min` → PresetResource.regen_time_budget_s → the regeneration request. A budget
    spent before the first conversation still writes the first records (an output is never left empty)
    and defers the rest; rerun with more, the step resumes the same staging output and answers the
    conversations deferred."""
    from resources import PresetResource

    storage = StorageResource(root=str(tmp_path))
    res = tiny_resources(storage, tiny_target_dir)
    run(["filtered_prompts"], res, instance, WORKLOAD)
    res["preset"] = PresetResource(name="tiny", regen_time_budget_s=1e-9)
    first = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    deferred = int(re.search(r"budget:time\D+(\d+)", str(first["by_reason"])).group(1))
    assert first["written"] >= 1 and deferred >= 1 and first["written"] + first["rejected"] == first["read"]
    res["preset"] = PresetResource(name="tiny", regen_time_budget_s=3600)
    m = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    assert m["deferred_retried"] == deferred and m["written"] + m["rejected"] == m["read"] == first["read"]
    assert m["time_budget_s"] == 3600 and "budget:time" not in str(m.get("by_reason", ""))


def test_staging_output_made_with_other_settings_is_replaced_not_refused(tmp_path, tiny_target_dir, instance):
    """A regeneration killed before an upgrade that changed its settings left output in its staging dir
    (same prompts and preset, so the same dir). The rerun discards it, says so, and regenerates: it does
    not fail the step with "written with another target or settings"."""
    from dataclasses import replace

    from assets.partitions import Keys
    from eagle3_platform.config import preset
    from eagle3_platform.data.regenerate import regenerate_file
    from eagle3_platform.store.records import read_jsonl, sha256_file

    storage = StorageResource(root=str(tmp_path))
    res = tiny_resources(storage, tiny_target_dir)
    run(["filtered_prompts"], res, instance, WORKLOAD)
    kept = storage.fetch(Keys.kept(WORKLOAD, "train"))
    stage = storage.staging(Keys.conversations(WORKLOAD, "train"), res["preset"].staging_key(sha256_file(kept)))
    now = preset("tiny").regen.max_new_tokens
    regenerate_file(tiny_target_dir, kept, stage / "conversations.jsonl",
                    replace(preset("tiny").regen, max_new_tokens=now - 1),
                    rejected_path=stage / "rejected.jsonl", scanner=False)
    m = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    assert f"max_new_tokens {now - 1} -> {now}" in m["discarded_stale"] and "eval_discarded_stale" not in m
    assert m["resumed"] == 0 and m["written"] + m["rejected"] == m["read"]
    records = list(read_jsonl(storage.local_path(Keys.conversations(WORKLOAD))))
    assert len(records) == m["records"] and {r["generation"]["max_new_tokens"] for r in records} == {now}


def test_a_raised_regeneration_budget_continues_the_published_responses_and_a_forced_run_starts_afresh(
        tmp_path, tiny_target_dir, instance, answer_clock):
    """Only the budget changed since the partition's last materialization: the step copies the published
    output back and answers what the smaller budget deferred or cut. `eagle3 run --force` (the rebuild
    tag) regenerates everything, and its records are the continued run's (fp32 greedy)."""
    from dagster import materialize

    from assets.partitions import Keys
    from assets.responses import REBUILD_TAG
    from dagster_helpers import GRAPH
    from eagle3_platform.store.records import read_jsonl
    from resources import PresetResource

    storage = StorageResource(root=str(tmp_path))
    res = tiny_resources(storage, tiny_target_dir)
    run(["filtered_prompts"], res, instance, WORKLOAD)
    conversations = storage.local_path(Keys.conversations(WORKLOAD))
    rejected = storage.local_path(Keys.responses_rejected(WORKLOAD))

    res["preset"] = PresetResource(name="tiny", regen_time_budget_s=2)  # 2 answered turns a split
    small = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    deferred = sum(r["reason"] == "budget:time" for r in read_jsonl(rejected))
    assert deferred >= 1 and small["written"] >= 1 and small["continue_version"]
    published = conversations.read_bytes()

    res["preset"] = PresetResource(name="tiny", regen_time_budget_s=3600)
    asked = answer_clock[0]
    big = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    asked = answer_clock[0] - asked
    assert big["continued_published"] == f"{small['written']} records"
    assert big["eval_continued_published"] == f"{small['eval_written']} records"
    assert big["deferred_retried"] == deferred and big["written"] + big["rejected"] == big["read"]
    assert not any(r["reason"] == "budget:time" for r in read_jsonl(rejected))
    whole = b"".join(line for line in published.splitlines(keepends=True) if b'"cut_by_time":false' in line)
    assert whole and conversations.read_bytes().startswith(whole)  # what the small budget made whole, kept
    continued = {r["id"]: r for r in read_jsonl(conversations)}

    again = answer_clock[0]
    forced = materialize(GRAPH, selection=["target_responses"], partition_key=WORKLOAD, instance=instance,
                         resources=res, tags={REBUILD_TAG: "true"})
    f = meta(forced, "target_responses")
    assert f["continued_published"] == "no: a forced rebuild (eagle3/rebuild)"
    assert f["resumed"] == 0 and f["written"] == big["written"]
    assert answer_clock[0] - again > asked  # every turn asked again
    assert {r["id"]: r for r in read_jsonl(conversations)} == continued


def test_more_prompts_per_workload_keep_the_published_answers_and_ask_only_the_new_prompts(
        tmp_path, tiny_target_dir, instance, answer_clock):
    """`eagle3 run --prompts-per-workload N` (the preset resource's `prompts_per_workload`): a larger N
    keeps the smaller one's prompts (sources are a prefix), so the responses step continues the
    published answers and asks only the new prompts; the unchanged eval split asks nothing. Feature
    extraction starts from the published shards and recomputes only those whose records changed."""
    from dagster import materialize

    from assets.partitions import Keys
    from assets.responses import REBUILD_TAG
    from dagster_helpers import GRAPH
    from eagle3_platform.store.records import read_jsonl
    from resources import PresetResource

    storage = StorageResource(root=str(tmp_path))
    res = tiny_resources(storage, tiny_target_dir)
    kept = storage.local_path(Keys.kept(WORKLOAD, "train"))
    conversations = storage.local_path(Keys.conversations(WORKLOAD))

    res["preset"] = PresetResource(name="tiny", prompts_per_workload=8)
    run(["filtered_prompts"], res, instance, WORKLOAD)
    small_ids = [r["id"] for r in read_jsonl(kept)]
    asked = answer_clock[0]
    small = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    asked_small = answer_clock[0] - asked
    published = conversations.read_bytes()
    f_small = meta(run(["feature_shards"], res, instance, WORKLOAD), "feature_shards")
    shards = storage.local_path(Keys.features(WORKLOAD, "train"))
    shard0 = (shards / "shard-00000.safetensors").read_bytes()

    res["preset"] = PresetResource(name="tiny", prompts_per_workload=16)
    grown = meta(run(["filtered_prompts"], res, instance, WORKLOAD), "filtered_prompts")
    ids = [r["id"] for r in read_jsonl(kept)]
    assert grown["read"] == 16 and ids[:len(small_ids)] == small_ids and len(ids) > len(small_ids)
    asked = answer_clock[0]
    big = meta(run(["target_responses"], res, instance, WORKLOAD), "target_responses")
    asked_big = answer_clock[0] - asked
    assert big["continued_published"] == f"{small['written']} records"
    assert big["eval_continued_published"] == f"{small['eval_written']} records"
    assert big["read"] == len(ids) and big["written"] + big["rejected"] == big["read"]
    assert conversations.read_bytes().startswith(published)
    assert big["prompts_sha256"] != small["prompts_sha256"]

    f_big = meta(run(["feature_shards"], res, instance, WORKLOAD), "feature_shards")
    full = f_small["samples"] // 4  # tiny: 4 samples a shard; the small build's full shards are unchanged
    assert full >= 1 and f_big["shards_seeded"] == f_small["shards"]
    assert f_big["shards_skipped"] >= full and f_big["shards_written"] == f_big["shards"] - f_big["shards_skipped"]
    assert f_big["samples"] > f_small["samples"] and (shards / "shard-00000.safetensors").read_bytes() == shard0
    assert f_big["eval_shards_skipped"] == f_big["eval_shards"]  # the eval split did not change

    asked = answer_clock[0]
    materialize(GRAPH, selection=["target_responses"], partition_key=WORKLOAD, instance=instance,
                resources=res, tags={REBUILD_TAG: "true"})
    # a rebuild asks both splits' every turn: the small build's (train + eval) and the new prompts'
    assert asked_big >= 1 and answer_clock[0] - asked == asked_small + asked_big


def test_a_head_on_grown_data_starts_from_the_published_head(tmp_path, tiny_target_dir, instance):
    """More prompts per workload grow the features; the head's rebuild starts from the published head
    (same code and settings, other inputs) and trains the preset's warm_start_epochs. The same inputs,
    or a forced rebuild, train from scratch."""
    from dagster import materialize

    from assets.metadata import REBUILD_TAG
    from assets.partitions import Keys
    from dagster_helpers import GRAPH
    from eagle3_platform.draft.train import PRESETS
    from eagle3_platform.store.records import sha256_file
    from resources import PresetResource

    storage = StorageResource(root=str(tmp_path))
    res = tiny_resources(storage, tiny_target_dir)
    data = ["filtered_prompts", "target_responses", "feature_shards"]
    res["preset"] = PresetResource(name="tiny", prompts_per_workload=8)
    run(data, res, instance, WORKLOAD)
    first = meta(run(["draft_vocab", "draft_head"], res, instance), "draft_head")
    assert first["warm_start"] == "no: the first build" and first["epochs"] == PRESETS["tiny"].epochs
    assert first["samples"] > 0 and first["samples_left_out"] == 0   # every conversation fits max_len
    published = sha256_file(storage.fetch(f"{Keys.DRAFT}/draft.safetensors"))

    res["preset"] = PresetResource(name="tiny", prompts_per_workload=16)
    run(data, res, instance, WORKLOAD)
    grown = meta(run(["draft_vocab", "draft_head"], res, instance), "draft_head")
    assert grown["warm_start"].startswith(f"from the published head ({published[:12]})"), grown["warm_start"]
    assert grown["epochs"] == PRESETS["tiny"].warm_start_epochs != PRESETS["tiny"].epochs
    assert grown["inputs_sha256"] != first["inputs_sha256"]
    assert sha256_file(storage.fetch(f"{Keys.DRAFT}/draft.safetensors")) != published  # it trained on

    again = meta(run(["draft_head"], res, instance), "draft_head")
    assert again["warm_start"] == "no: the published head was trained on these inputs"
    assert again["epochs"] == PRESETS["tiny"].epochs
    forced = materialize(GRAPH, selection=["draft_head"], instance=instance, resources=res,
                         tags={REBUILD_TAG: "true"})
    assert meta(forced, "draft_head")["warm_start"] == f"no: a forced rebuild ({REBUILD_TAG})"
