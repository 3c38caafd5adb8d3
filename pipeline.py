"""Run the whole graph through Dagster: `python -m pipeline [--preset demo] [--target M]
[--workloads chat,code] [--through ASSET] [--env local|gcp] [--force]`.

Materializes, in a persistent project-local Dagster instance (so every run shows up in
`dagster dev -w workspace.yaml`), what the asset graph needs up to `--through` and Dagster's records
say is missing or stale: never materialized, materialized under another code version (code or
resolved settings changed, assets/versions.py), an upstream materialized since, a source whose
observed data version changed since, or an output the latest materialization names that is gone
from storage. Steps follow the graph: each workload partition (prompts → responses → features), then
each unpartitioned asset (vocab → head + its blocking check → deployment → benchmark report).
`--force` rebuilds everything. The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import unquote

os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
# Facts shown in the progress line of a step (from its materialization metadata).
FACTS = ("read", "kept", "rejected", "written", "samples", "tokens", "new_tokens", "time_spent_s",
         "draft_vocab_size", "coverage", "steps", "train_simulated_acceptance", "heldout_simulated_acceptance",
         "mode", "url", "smoke_latency_s", "eagle3_tau", "tpot_speedup", "failures")


def log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    from eagle3_platform.config import DEFAULT_PRESET, PRESET_NAMES
    from eagle3_platform.records import WORKLOADS

    p = argparse.ArgumentParser(prog="pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=os.environ.get("EAGLE3_PRESET", DEFAULT_PRESET), choices=PRESET_NAMES)
    p.add_argument("--target", default=None, help="smollm2-135m-instruct | tiny-random | PATH")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated partitions")
    p.add_argument("--through", default="benchmark_report", help="last asset to build")
    p.add_argument("--env", default=None, choices=["local", "gcp"], help="default: $EAGLE3_ENV or local")
    p.add_argument("--data-dir", default=None, help="local storage root (default ./data)")
    p.add_argument("--dagster-home", default=None, help="default: $DAGSTER_HOME or ./.dagster_home")
    p.add_argument("--dtype", default=None, help="compute dtype override: auto | bfloat16 | float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads override (0 = every core)")
    p.add_argument("--regen-budget-min", type=float, default=None,
                   help="regeneration wall minutes per partition and split, across resumes (default: the "
                        "preset's; 0 = no limit); a new value continues the published responses")
    p.add_argument("--prompts-per-workload", type=int, default=None,
                   help="train prompts per workload (default: the preset's); a larger set keeps the "
                        "prompts already answered and asks only the new ones")
    p.add_argument("--force", action="store_true", help="rebuild steps that are neither missing nor stale")
    a = p.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = sorted(set(a.workloads) - set(WORKLOADS))
    if bad:
        p.error(f"unknown workloads {bad}; expected some of {list(WORKLOADS)}")
    if a.regen_budget_min is not None and not a.regen_budget_min >= 0:  # NaN too
        p.error(f"--regen-budget-min {a.regen_budget_min}: minutes must be >= 0 (0 = no limit)")
    if a.prompts_per_workload is not None and a.prompts_per_workload < 1:
        p.error(f"--prompts-per-workload {a.prompts_per_workload}: must be >= 1")
    return a


# ---- the plan: steps from the asset graph ---------------------------------------------------------
def plan(graph, through: str, workloads: list[str]) -> list[tuple[str, list, str | None]]:
    """[(step name, asset keys in graph order, partition)] for everything `through` needs."""
    from dagster import AssetKey

    target = AssetKey(through)
    if target not in graph.materializable_asset_keys:
        names = sorted(k.to_user_string() for k in graph.materializable_asset_keys)
        raise ValueError(f"--through {through!r}: expected one of {', '.join(names)}")
    needed, todo = set(), [target]
    while todo:
        key = todo.pop()
        if key not in needed and graph.get(key).is_materializable:
            needed.add(key)
            todo.extend(graph.get(key).parent_keys)
    keys = [k for k in graph.toposorted_asset_keys if k in needed]
    partitioned = [k for k in keys if graph.get(k).partitions_def is not None]
    steps = [(f"partition:{w}", partitioned, w) for w in workloads] if partitioned else []
    return steps + [(k.to_user_string(), [k], None) for k in keys if k not in partitioned]


# ---- missing or stale, from the instance's records --------------------------------------------------
def _latest(instance, key, partitions=None, before=None, observations=False):
    from dagster import AssetRecordsFilter

    flt = AssetRecordsFilter(asset_key=key, asset_partitions=partitions, before_storage_id=before)
    fetch = instance.fetch_observations if observations else instance.fetch_materializations
    recs = fetch(flt, limit=1).records
    return recs[0] if recs else None


def _data_version(record) -> str | None:
    return record.asset_observation.tags.get("dagster/data_version") if record else None


def stale_reason(instance, graph, storage, key, partition) -> str | None:
    """Why (key, partition) must be (re)built, or None when its latest materialization is current."""
    node = graph.get(key)
    mat = _latest(instance, key, [partition] if partition else None)
    if mat is None:
        return "missing"
    if mat.asset_materialization.tags.get("dagster/code_version") != node.code_version:
        return "code or settings changed"
    for parent in sorted(node.parent_keys):
        scope = [partition] if partition and graph.get(parent).partitions_def is not None else None
        if not graph.get(parent).is_materializable:  # observed source: did its data version change since?
            now = _data_version(_latest(instance, parent, scope, observations=True))
            then = _data_version(_latest(instance, parent, scope, mat.storage_id, observations=True))
            if now != then:
                return f"{parent.to_user_string()} data version changed"
        else:
            up = _latest(instance, parent, scope)
            if up is not None and up.storage_id > mat.storage_id:
                return f"{parent.to_user_string()} materialized since"
    gone = [v for k, v in _metadata(mat).items() if k.endswith("_uri") and not _stored(storage, v)]
    return f"output gone: {gone[0]}" if gone else None


def _stored(storage, uri: str) -> bool:
    root = storage.uri("").rstrip("/")
    if not uri.startswith(root):
        return True  # not in this storage: nothing to check
    key = unquote(uri[len(root):].strip("/"))  # file URIs are percent-encoded
    return storage.exists(key) or bool(storage.list(key))


def _metadata(record) -> dict:
    meta = record.asset_materialization.metadata
    return {k: getattr(v, "value", v) for k, v in meta.items()}  # MetadataValue → its plain value


# ---- running -------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> dict:
    from definitions import build_definitions
    from resources.instance import project_instance

    if a.data_dir:
        os.environ["EAGLE3_DATA_DIR"] = str(Path(a.data_dir).resolve())
    instance = project_instance(a.dagster_home)
    home = Path(os.environ["DAGSTER_HOME"])
    budget = None if a.regen_budget_min is None else a.regen_budget_min * 60
    defs = build_definitions(env=a.env, preset=a.preset, target=a.target, dtype=a.dtype, torch_threads=a.threads,
                             regen_time_budget_s=budget, prompts_per_workload=a.prompts_per_workload)
    res = defs.resources
    log(f"preset={a.preset} target={res['target'].model} env={a.env or os.environ.get('EAGLE3_ENV', 'local')} "
        f"storage={res['storage'].uri('')} DAGSTER_HOME={home}")
    t0 = time.perf_counter()
    tmeta = res["target"].meta()  # prepares (and caches) the target once, before any step needs it
    log(f"target ready: {tmeta['target_id']} ({time.perf_counter() - t0:.1f}s)")
    graph = defs.resolve_asset_graph()
    steps = plan(graph, a.through, a.workloads)
    if not defs.resolve_job_def("observe_workload_sources").execute_in_process(instance=instance).success:
        raise RuntimeError("observing workload_sources failed — see the run log in the Dagster UI")
    done = [_step(instance, defs, graph, name, keys, partition, a.force) for name, keys, partition in steps]
    wall = time.perf_counter() - t0
    outputs = recorded_outputs(instance, steps)
    headline = _headline(instance, graph)
    log(f"done in {wall:.1f}s")
    for k, v in sorted(outputs.items()):
        print(f"  {k}: {v}", file=sys.stderr)
    return {"preset": a.preset, "target": tmeta["target_id"], "workloads": a.workloads, "through": a.through,
            "steps": done, "outputs": outputs, "headline": headline, "wall_s": round(wall, 1),
            "dagster_home": str(home)}


def _step(instance, defs, graph, name, keys, partition, force) -> dict:
    from dagster import materialize

    from assets.responses import REBUILD_TAG

    storage = defs.resources["storage"]
    reasons = {k: "--force" if force else stale_reason(instance, graph, storage, k, partition) for k in keys}
    first = next((i for i, k in enumerate(keys) if reasons[k]), None)
    if first is None:
        log(f"{name}: up to date, skipped (--force to rebuild)")
        return {"step": name, "skipped": True}
    selection = keys[first:]  # everything downstream of a rebuilt asset rebuilds with it
    log(f"{name}: materializing {' → '.join(k.to_user_string() for k in selection)} "
        f"({keys[first].to_user_string()}: {reasons[keys[first]]})")
    t = time.perf_counter()
    result = materialize([*defs.assets, *defs.asset_checks], selection=selection, partition_key=partition,
                         instance=instance, resources=defs.resources, run_config=RUN_CONFIG, raise_on_error=False,
                         tags={"eagle3/launched_by": "pipeline", **({REBUILD_TAG: "true"} if force else {})})
    dt = time.perf_counter() - t
    if not result.success:
        raise RuntimeError(f"{name} failed after {dt:.0f}s (run {result.run_id}); "
                           f"{_failure(result)} — see `dagster dev -w workspace.yaml` for the run log")
    for key in selection:
        mat = _latest(instance, key, [partition] if partition else None)
        facts = " ".join(f"{k}={v}" for k, v in _metadata(mat).items() if k in FACTS)
        log(f"{name}: {key.to_user_string()} ok {facts}")
    log(f"{name}: done in {dt:.1f}s")
    return {"step": name, "seconds": round(dt, 1), "run_id": result.run_id,
            "materialized": [k.to_user_string() for k in selection]}


def recorded_outputs(instance, steps) -> dict:
    """The URI-valued metadata of the latest materialization of every (asset, partition) in the plan."""
    out = {}
    for _, keys, partition in steps:
        for key in keys:
            mat = _latest(instance, key, [partition] if partition else None)
            for k, v in (_metadata(mat) if mat else {}).items():
                if k.endswith("_uri"):
                    out[f"{key.to_user_string()}{'/' + partition if partition else ''}:{k}"] = str(v)
    return out


def _headline(instance, graph) -> dict:
    """The benchmark's headline figures (numbers from the latest benchmark_report materialization)."""
    from dagster import AssetKey

    key = AssetKey("benchmark_report")
    mat = _latest(instance, key) if key in graph.materializable_asset_keys else None
    meta = _metadata(mat) if mat else {}
    return {k: v for k, v in meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _failure(result) -> str:
    for ev in result.all_events:
        if ev.is_step_failure:
            err = ev.step_failure_data.error
            while err is not None and err.cause is not None:  # the library's own exception, not the wrapper
                err = err.cause
            if err is not None and err.cls_name == "DagsterExecutionInterruptedError":
                return (f"{ev.step_key}: interrupted (a signal stopped it); rerun the same command to go on "
                        "where it stopped")
            return f"{ev.step_key}: {err.message.strip() if err else 'failed'}"
        if ev.event_type_value == "ASSET_CHECK_EVALUATION" and not ev.event_specific_data.passed:
            d = ev.event_specific_data
            return f"blocking check {d.check_name} failed: {dict((k, getattr(v, 'value', v)) for k, v in d.metadata.items())}"
    return "unknown failure"


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        summary = {"ok": True, **run(a)}
        rc = 0
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        log(f"error: {e}")
        summary, rc = {"ok": False, "error": str(e)}, 1
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
