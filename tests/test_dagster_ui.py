"""What the Dagster UI shows: plots embedded in asset metadata as PNG data URIs (the UI's markdown
renderer allows data: image sources), returned as such by the UI's GraphQL API; typed, rounded
metadata with numeric keys in numeric order; a description and owners on every asset."""
import base64
import re
from contextlib import contextmanager
from pathlib import Path

import pytest
from dagster import AssetKey, AssetMaterialization, DagsterInstance

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
DATA_URI = re.compile(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)")
LATEST = """query($key: AssetKeyInput!) { assetOrError(assetKey: $key) { __typename ... on Asset {
  assetMaterializations(limit: 1) { metadataEntries { label __typename
    ... on MarkdownMetadataEntry { mdStr } ... on PathMetadataEntry { path }
    ... on FloatMetadataEntry { floatValue }
    ... on TableMetadataEntry { table { records schema { columns { name type } } } } } } } } }"""


def pngs(md: str) -> list[bytes]:
    return [base64.b64decode(x) for x in DATA_URI.findall(md)]


def ui_instance():
    """A persistent instance in a temporary DAGSTER_HOME, as the webserver uses (an ephemeral one
    cannot back a workspace)."""
    from dagster._core.test_utils import instance_for_test

    return instance_for_test()


@contextmanager
def ui_context(instance):
    """The request context the webserver answers GraphQL with, over this project's definitions
    loaded in-process."""
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(
        python_file=str(ROOT / "definitions.py"), attribute="defs", working_directory=str(ROOT)),
        location_name="definitions")
    with WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as process:
        yield process.create_request_context()


def latest_entries(instance, asset: str) -> dict[str, dict]:
    from dagster_graphql.test.utils import execute_dagster_graphql

    with ui_context(instance) as ctx:
        res = execute_dagster_graphql(ctx, LATEST, {"key": {"path": [asset]}})
    assert not res.errors, res.errors
    (mat,) = res.data["assetOrError"]["assetMaterializations"]
    return {e["label"]: e for e in mat["metadataEntries"]}


def sweep_results(levels=(1, 2, 4, 8, 16)) -> dict:
    from eagle3_platform.bench.run import headline

    def cell(tpot_s, tps, c):
        return {"requests": 10 * c, "failures": 0, "median_ttft_s": 0.05 * c, "p90_ttft_s": 0.07 * c,
                "median_tpot_s": tpot_s, "p10_tpot_s": tpot_s * 0.8, "p90_tpot_s": tpot_s * 1.3,
                "output_tokens": 100, "wall_s": 5.0, "output_tok_per_s": tps,
                "accepted_tokens": 30 if tps > 40 else 10, "verify_steps": 10}
    runs = [{"endpoint": ep, "concurrency": c, "cells": {"all": cell(t, s * c, c), "chat": cell(t, s * c, c)}}
            for c in reversed(levels) for ep, t, s in (("eagle3", 0.02, 50.0), ("baseline", 0.04, 25.0))]
    results = {"config": {"concurrency": list(levels), "duration_s": 5, "max_tokens": 16,
                          "prompts": "/tmp/x/.staging/bench/prompts.jsonl", "n_prompts": 3, "workloads": ["chat"],
                          "endpoints": {"baseline": "u0", "eagle3": "u1"}}, "runs": runs}
    results["headline"] = headline(results)
    return results


def test_benchmark_report_metadata_tables_keep_every_column_where_cells_are_empty(tmp_path):
    """A slow box can finish no request of a workload at some level, or none at all in a cell: the
    tables still hold one set of fields per row (Dagster refuses ragged ones), None where empty."""
    from assets.bench import report_metadata
    from eagle3_platform.bench.report import write_report

    results = sweep_results(levels=(1, 2))
    for run in results["runs"]:
        if run["concurrency"] == 1:
            run["cells"]["code"] = dict(run["cells"]["chat"])  # code answered at c = 1 only
        if (run["endpoint"], run["concurrency"]) == ("eagle3", 2):
            run["cells"]["all"] = {"requests": 0, "failures": 0}  # nothing finished in the cell
    write_report(results, tmp_path / "report")
    meta = report_metadata(tmp_path / "report", (tmp_path / "published").as_uri())
    for name in ("cells", "speedup_by_concurrency", "tau_by_workload"):
        records = meta[name].value.records
        assert len({frozenset(r.data) for r in records}) == 1, name
    empty = [r.data for r in meta["cells"].value.records if r.data["endpoint"] == "eagle3" and r.data["concurrency"] == 2]
    assert empty[0]["median_tpot_ms"] is None and empty[0]["requests"] == 0
    code = [r.data for r in meta["tau_by_workload"].value.records if r.data["workload"] == "code"][0]
    assert code["c2"] is None and code["c1"] is not None
    assert meta["speedup_by_concurrency"].value.records[1].data["tpot_speedup"] is None


def test_benchmark_report_metadata_embeds_its_plots_and_the_ui_api_returns_them(tmp_path):
    from assets.bench import PLOT_ENTRIES, report_metadata
    from eagle3_platform.bench.report import write_report

    write_report(sweep_results(), tmp_path / "report")
    meta = report_metadata(tmp_path / "report", (tmp_path / "published").as_uri())
    assert set(PLOT_ENTRIES) <= set(meta)  # TPOT, throughput, TTFT, speedup, τ
    for name in PLOT_ENTRIES:
        (png,) = pngs(meta[name].value)
        assert png.startswith(PNG) and len(png) > 1000
    assert len(pngs(meta["report"].value)) == len(PLOT_ENTRIES)  # the report's own images inline too
    assert "](tpot_vs_concurrency.png)" not in meta["report"].value  # no relative link left to break
    assert ".staging" not in meta["report"].value
    cells = meta["cells"].value.records
    assert [r.data["concurrency"] for r in cells] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]  # numeric, not text
    assert cells[0].data["endpoint"] == "baseline" and cells[1].data["p10_tpot_ms"] == pytest.approx(16.0)
    sp = meta["speedup_by_concurrency"].value.records
    assert [r.data["concurrency"] for r in sp] == [1, 2, 4, 8, 16]
    assert all(r.data["tpot_speedup"] == pytest.approx(2.0) for r in sp)
    assert meta["tau_by_workload"].value.records[0].data["c16"] == pytest.approx(3.0)
    for key, suffix in (("report_uri", "/published/report/report.md"),
                        ("report_html_uri", "/published/report/report.html")):
        assert type(meta[key]).__name__ == "PathMetadataValue"
        assert meta[key].value == str(tmp_path) + suffix  # a plain path: file:// does not open from the UI

    with ui_instance() as instance:
        instance.report_runless_asset_event(AssetMaterialization("benchmark_report", metadata=meta))
        entries = latest_entries(instance, "benchmark_report")
    assert entries["plot_speedup"]["__typename"] == "MarkdownMetadataEntry"
    for name in PLOT_ENTRIES:
        (png,) = pngs(entries[name]["mdStr"])
        assert png.startswith(PNG)
    columns = [c["name"] for c in entries["cells"]["table"]["schema"]["columns"]]
    assert columns[:2] == ["endpoint", "concurrency"] and "p90_tpot_ms" in columns
    assert not entries["report_uri"]["path"].startswith("file://")


def test_dict_tables_sort_numeric_keys_numerically_and_floats_are_rounded():
    from assets.metadata import dict_table, location, rounded, summary_metadata

    t = dict_table({"16": 1.23456789, "2": 2.0, "1": 3.5, "8": 0.000123456, "4": 1.0})
    assert [r.data["name"] for r in t.value.records] == ["1", "2", "4", "8", "16"]
    assert t.value.records[-1].data["value"] == 1.235 and t.value.records[3].data["value"] == 0.0001235
    assert [c.type for c in t.value.schema.columns] == ["string", "float"]
    assert rounded(123456.789) == 123456.8 and rounded(2 / 3) == 0.6667
    m = summary_metadata({"n": 3, "x": 1 / 3, "ratio": {"16": 1.0, "2": 2.0}, "where": "file:///a/b c"})
    assert m["n"].value == 3 and m["x"].value == 0.3333
    assert [r.data["name"] for r in m["ratio"].value.records] == ["2", "16"]
    assert m["where"].value == "/a/b c" and location("gs://b/k").value == "gs://b/k"
    assert type(location("https://h/x")).__name__ == "UrlMetadataValue"


def test_every_asset_has_a_description_and_owners():
    from assets import ALL_ASSETS

    specs = [s for a in ALL_ASSETS for s in a.specs]
    assert len(specs) == len(ALL_ASSETS)  # the observable source too (an observation-only definition)
    for spec in specs:
        assert spec.description and len(spec.description) > 20, spec.key
        assert spec.owners == ["team:ml-platform"], spec.key
    (source,) = [a for a in ALL_ASSETS if a.is_observable]
    assert source.key == AssetKey("workload_sources") and not source.is_materializable


def test_source_observations_carry_files_and_bytes_beside_the_data_version():
    from dagster import Definitions

    from assets.sources import workload_sources

    with DagsterInstance.ephemeral() as instance:
        defs = Definitions(assets=[workload_sources])
        job = defs.get_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=instance).success
        recs = instance.fetch_observations(AssetKey("workload_sources"), limit=20).records
    assert {r.partition_key for r in recs} == {"chat", "multi_turn", "code", "math", "long_context"}
    for r in recs:
        obs = r.asset_observation
        assert len(obs.tags["dagster/data_version"]) == 64
        assert obs.metadata["files"].value >= 1 and obs.metadata["bytes"].value > 0
        assert obs.metadata["fingerprint"].value == obs.tags["dagster/data_version"]


def test_draft_head_page_shows_its_training_curves(tmp_path, tiny_target_dir):
    """A tiny training through Dagster: its loss and acceptance curves are PNGs inline in the
    materialization's markdown, as the UI's GraphQL API returns it."""
    from dagster_helpers import meta, run, tiny_resources
    from eagle3_platform.store.records import sha256_file
    from resources import StorageResource

    storage = StorageResource(root=str(tmp_path / "data"))
    res = tiny_resources(storage, tiny_target_dir)
    with ui_instance() as instance:
        run(["filtered_prompts", "target_responses", "feature_shards"], res, instance, "code")
        m = meta(run(["draft_vocab", "draft_head"], res, instance), "draft_head")
        entries = latest_entries(instance, "draft_head")
    curves = pngs(m["training_curves"])
    assert len(curves) == 2 and all(p.startswith(PNG) for p in curves)  # curves + held-out per position
    (ui,) = [e for k, e in entries.items() if k == "training_curves"]
    assert [p[:8] for p in pngs(ui["mdStr"])] == [PNG, PNG]
    assert entries["final_loss"]["__typename"] == "FloatMetadataEntry" and entries["final_loss"]["floatValue"] > 0
    assert not entries["export_uri"]["path"].startswith("file://")
    assert m["head_sha256"] == sha256_file(storage.fetch("draft/export/model.safetensors"))  # the report names it
