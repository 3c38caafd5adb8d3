"""`eagle3 run`'s Dagster side: `python -m assets.launch '<the parsed flags as JSON>'`.

eagle3_platform/cli/run.py declares and checks the flags; this module only reads them back. In the
project's persistent instance (what `dagster dev -w workspace.yaml` shows) it observes the workload
sources, then walks the steps up to `--through`: each chosen workload partition (prompts → responses →
features), then each unpartitioned asset (vocab → head + its blocking check → deployment → benchmark
report). A step runs when Dagster's stale-status resolver (the one the UI uses) reports one of its assets
missing or stale; that asset and everything after it in the step are launched as a run of the named job
that holds them (assets/jobs.py). `--force` rebuilds every step. The last line printed is a JSON summary.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from dagster import AssetKey, AssetRecordsFilter, AssetSelection
# The UI's own stale-status resolver and run machinery: private in Dagster (pinned in pyproject.toml).
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.definitions.job_base import InMemoryJob
from dagster._core.execution.api import execute_run
from dagster._core.execution.execute_in_process import merge_run_tags
from dagster._time import get_current_datetime

from assets.deploy import not_serving, servers
from assets.jobs import JOB_OF, SERVE
from assets.metadata import REBUILD_TAG, location
from assets.runs import fail_abandoned_runs, launcher_tag
from resources.instance import job_origin, project_instance

RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
LAUNCHED_BY = {"eagle3/launched_by": "eagle3 run"}
# Facts shown in the progress line of a step (from its materialization metadata).
FACTS = ("read", "kept", "rejected", "written", "samples", "tokens", "new_tokens", "time_spent_s",
         "draft_vocab_size", "coverage", "steps", "train_simulated_acceptance", "heldout_simulated_acceptance",
         "mode", "url", "smoke_latency_s", "eagle3_tau", "tpot_speedup", "failures")


def log(msg: str) -> None:
    print(f"[eagle3 run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the plan: steps from the asset graph ---------------------------------------------------------
def plan(graph, through: str, workloads: list[str]) -> list[tuple[str, list, str | None]]:
    """[(step name, asset keys in graph order, partition)] for everything `through` needs."""
    if AssetKey(through) not in graph.materializable_asset_keys:
        names = sorted(k.to_user_string() for k in graph.materializable_asset_keys)
        raise ValueError(f"--through {through!r}: expected one of {', '.join(names)}")
    needed = AssetSelection.assets(through).upstream().resolve(graph) & graph.materializable_asset_keys
    keys = [k for k in graph.toposorted_asset_keys if k in needed]
    partitioned = [k for k in keys if graph.get(k).partitions_def is not None]
    steps = [(f"partition:{w}", partitioned, w) for w in workloads] if partitioned else []
    return steps + [(k.to_user_string(), [k], None) for k in keys if k not in partitioned]


# ---- missing or stale: Dagster's answer ------------------------------------------------------------
def stale_resolver(instance, graph) -> CachingStaleStatusResolver:
    """The resolver the UI's stale badges come from; it caches, so one per look at the instance."""
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    return CachingStaleStatusResolver(instance=instance, asset_graph=graph, loading_context=view)


def rebuild_reason(resolver, instance, storage, key, partition) -> str | None:
    """Why (key, partition) must be (re)built, or None when Dagster reports it fresh and its outputs stored."""
    status = resolver.get_status(key, partition)
    if status is StaleStatus.MISSING:
        return "missing"
    if status is StaleStatus.STALE:
        cause = resolver.get_stale_causes(key, partition)[0]
        return cause.reason + (f" ({_name(cause.dependency)})" if cause.dependency else "")
    # Dagster records what was materialized, not whether it is still stored: an output deleted since
    # (its *_uri metadata names it) is missing all the same.
    mat = _latest(instance, key, partition)
    gone = [v for k, v in _metadata(mat).items() if k.endswith("_uri") and not _stored(storage, v)]
    return f"output gone: {gone[0]}" if gone else None


def _name(asset_partition) -> str:
    pk = asset_partition.partition_key
    return asset_partition.asset_key.to_user_string() + (f"[{pk}]" if pk else "")


def _stored(storage, recorded: str) -> bool:
    """Whether a recorded location (a path, or a file:// or gs:// URI) is still in storage."""
    root = location(storage.uri("")).value.rstrip("/")  # the form the metadata records
    where = location(recorded).value
    if not where.startswith(root):
        return True  # not in this storage: nothing to check
    key = where[len(root):].strip("/")
    return storage.exists(key) or bool(storage.list(key))


def _latest(instance, key, partition=None):
    flt = AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None)
    recs = instance.fetch_materializations(flt, limit=1).records
    return recs[0] if recs else None


def _metadata(record) -> dict:
    meta = record.asset_materialization.metadata if record else {}
    return {k: getattr(v, "value", v) for k, v in meta.items()}  # MetadataValue → its plain value


# ---- launching the named jobs ------------------------------------------------------------------------
def launch(instance, defs, job_name: str, selection=None, partition=None, tags=None):
    """One run of the defined job `job_name` over `selection` (None: the whole job), executed here and
    recorded in the instance as belonging to the workspace's code location (so the UI can re-execute it)."""
    job = defs.resolve_job_def(job_name)
    tags = merge_run_tags(job, partition, {**LAUNCHED_BY, **launcher_tag(), **(tags or {})}, selection, instance,
                          RUN_CONFIG)
    run = instance.create_run_for_job(job_def=job, run_config=RUN_CONFIG, tags=tags,
                                      asset_selection=frozenset(selection) if selection else None,
                                      remote_job_origin=job_origin(job_name))
    return execute_run(InMemoryJob(job), run, instance)


def step(instance, defs, name, keys, partition, force: bool, tags: dict) -> dict:
    graph, storage = defs.resolve_asset_graph(), defs.resources["storage"]
    resolver = stale_resolver(instance, graph)
    reasons = {k: "--force" if force else rebuild_reason(resolver, instance, storage, k, partition)
               or not_serving(defs.resources, k) for k in keys}
    first = next((i for i, k in enumerate(keys) if reasons[k]), None)
    if first is None:
        log(f"{name}: up to date, skipped (--force to rebuild)")
        return {"step": name, "skipped": True}
    selection = keys[first:]  # everything downstream of a rebuilt asset rebuilds with it
    job = JOB_OF[selection[0].to_user_string()]
    log(f"{name}: materializing {' → '.join(k.to_user_string() for k in selection)} as a run of {job} "
        f"({keys[first].to_user_string()}: {reasons[keys[first]]})")
    t = time.perf_counter()
    result = launch(instance, defs, job, selection, partition,
                    {**tags, **_head_tag(instance, selection), **({REBUILD_TAG: "true"} if force else {})})
    dt = time.perf_counter() - t
    if not result.success:
        raise RuntimeError(f"{name} failed after {dt:.0f}s (run {result.run_id}); "
                           f"{_failure(result)} — see `dagster dev -w workspace.yaml` for the run log")
    for key in selection:
        facts = " ".join(f"{k}={v}" for k, v in _metadata(_latest(instance, key, partition)).items() if k in FACTS)
        log(f"{name}: {key.to_user_string()} ok {facts}")
    log(f"{name}: done in {dt:.1f}s")
    return {"step": name, "seconds": round(dt, 1), "run_id": result.run_id,
            "materialized": [k.to_user_string() for k in selection]}


def _head_tag(instance, selection) -> dict:
    """The head a serving run deploys or benchmarks: the data version of the latest draft_head."""
    if not any(k.to_user_string() in SERVE for k in selection):
        return {}
    mat = _latest(instance, AssetKey("draft_head"))
    version = mat.asset_materialization.tags.get("dagster/data_version") if mat else None
    return {"eagle3/head": version} if version else {}


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


# ---- the whole run ------------------------------------------------------------------------------------
def definitions_for(a: SimpleNamespace):
    """The Definitions `eagle3 run`'s flags select (what `dagster dev` builds from the environment)."""
    from definitions import build_definitions

    budget = None if a.regen_budget_min is None else a.regen_budget_min * 60
    return build_definitions(env=a.env, preset=a.preset, target=a.target, dtype=a.dtype, torch_threads=a.threads,
                             regen_time_budget_s=budget, prompts_per_workload=a.prompts_per_workload)


def run(a: SimpleNamespace) -> dict:
    if a.data_dir:
        os.environ["EAGLE3_DATA_DIR"] = str(Path(a.data_dir).resolve())
    instance = project_instance(a.dagster_home)
    home = Path(os.environ["DAGSTER_HOME"])
    for run_id in fail_abandoned_runs(instance):
        log(f"run {run_id}: marked failed (its launcher was killed before it ended)")
    defs = definitions_for(a)
    res = defs.resources
    for pid in servers(res["storage"]).reap():
        log(f"stopped server pid {pid}: left running by a run that was killed")
    log(f"preset={a.preset} target={res['target'].model} env={a.env or os.environ.get('EAGLE3_ENV', 'local')} "
        f"storage={res['storage'].uri('')} DAGSTER_HOME={home}")
    t0 = time.perf_counter()
    tmeta = res["target"].meta()  # prepares (and caches) the target once, before any step needs it
    log(f"target ready: {tmeta['target_id']} ({time.perf_counter() - t0:.1f}s)")
    steps = plan(defs.resolve_asset_graph(), a.through, a.workloads)
    tags = {"eagle3/preset": a.preset, "eagle3/target": tmeta["target_id"]}
    if not launch(instance, defs, "observe_workload_sources", tags=tags).success:
        raise RuntimeError("observing workload_sources failed — see the run log in the Dagster UI")
    done = [step(instance, defs, name, keys, partition, a.force, tags) for name, keys, partition in steps]
    wall = time.perf_counter() - t0
    outputs = recorded_outputs(instance, steps)
    log(f"done in {wall:.1f}s")
    for k, v in sorted(outputs.items()):
        print(f"  {k}: {v}", file=sys.stderr)
    return {"preset": a.preset, "target": tmeta["target_id"], "workloads": a.workloads, "through": a.through,
            "steps": done, "outputs": outputs, "headline": _headline(instance), "wall_s": round(wall, 1),
            "dagster_home": str(home)}


def recorded_outputs(instance, steps) -> dict:
    """The URI-valued metadata of the latest materialization of every (asset, partition) in the plan."""
    out = {}
    for _, keys, partition in steps:
        for key in keys:
            for k, v in _metadata(_latest(instance, key, partition)).items():
                if k.endswith("_uri"):
                    out[f"{key.to_user_string()}{'/' + partition if partition else ''}:{k}"] = str(v)
    return out


def _headline(instance) -> dict:
    """The benchmark's headline figures (numbers from the latest benchmark_report materialization)."""
    meta = _metadata(_latest(instance, AssetKey("benchmark_report")))
    return {k: v for k, v in meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def main(argv: list[str]) -> int:
    try:
        summary = {"ok": True, **run(SimpleNamespace(**json.loads(argv[0])))}
        rc = 0
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        log(f"error: {e}")
        summary, rc = {"ok": False, "error": str(e)}, 1
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
