"""Run the whole graph through Dagster: `python -m pipeline [--preset demo] [--target M]
[--workloads chat,code] [--through ASSET] [--env local|gcp] [--force]`.

Materializes the partitioned assets workload by workload (prompts → responses → features), then the
unpartitioned ones (vocab → head + its blocking check → deployment → benchmark report), in a
persistent project-local Dagster instance, so every run shows up in `dagster dev -w workspace.yaml`.
A step whose inputs (preset, target, source fingerprint, upstream steps) did not change since its last
success is skipped (`--force` reruns everything). The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARTITIONED = ("filtered_prompts", "target_responses", "feature_shards")
GLOBAL = ("draft_vocab", "draft_head", "deployment", "benchmark_report")
ORDER = PARTITIONED + GLOBAL
STATE_FILE = "eagle3_pipeline_state.json"
RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    from eagle3_platform.config import PRESET_NAMES
    from eagle3_platform.records import WORKLOADS

    p = argparse.ArgumentParser(prog="pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=os.environ.get("EAGLE3_PRESET", "demo"), choices=PRESET_NAMES)
    p.add_argument("--target", default=None, help="smollm2-135m-instruct | tiny-random | PATH")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated partitions")
    p.add_argument("--through", default="benchmark_report", choices=ORDER, help="last asset to build")
    p.add_argument("--env", default=None, choices=["local", "gcp"], help="default: $EAGLE3_ENV or local")
    p.add_argument("--data-dir", default=None, help="local storage root (default ./data)")
    p.add_argument("--dagster-home", default=None, help="default: $DAGSTER_HOME or ./.dagster_home")
    p.add_argument("--force", action="store_true", help="rebuild steps whose inputs did not change")
    a = p.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = sorted(set(a.workloads) - set(WORKLOADS))
    if bad:
        p.error(f"unknown workloads {bad}; expected some of {list(WORKLOADS)}")
    return a


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class State:
    """Which step last succeeded with which input key (lives beside the Dagster instance)."""

    def __init__(self, home: Path):
        self.path = home / STATE_FILE
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def done(self, step: str, key: str) -> bool:
        return self.data.get(step) == key

    def mark(self, step: str, key: str) -> None:
        self.data[step] = key
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)


def _uris(result, names) -> dict:
    """The URI-valued metadata of each materialization in an in-process result."""
    out = {}
    for name in names:
        for mat in result.asset_materializations_for_node(name):
            for k, v in mat.metadata.items():
                if k.endswith("_uri"):
                    out[f"{name}{'/' + mat.partition if mat.partition else ''}:{k}"] = str(
                        getattr(v, "value", v) if not hasattr(v, "path") else v.path)
    return out


def _recorded_uris(instance, names, partition) -> dict:
    """URIs of the latest recorded materializations (for steps skipped in this invocation)."""
    from dagster import AssetKey, AssetRecordsFilter

    out = {}
    for name in names:
        recs = instance.fetch_materializations(AssetRecordsFilter(
            asset_key=AssetKey(name), asset_partitions=[partition] if partition else None), limit=1).records
        for r in recs:
            for k, v in r.asset_materialization.metadata.items():
                if k.endswith("_uri"):
                    out[f"{name}{'/' + partition if partition else ''}:{k}"] = str(getattr(v, "value", v))
    return out


def _counts(result, name) -> str:
    facts = []
    for mat in result.asset_materializations_for_node(name):
        for k in ("read", "kept", "rejected", "written", "samples", "tokens", "new_tokens",
                  "draft_vocab_size", "coverage", "steps", "train_simulated_acceptance",
                  "heldout_simulated_acceptance", "mode", "url", "smoke_latency_s", "eagle3_tau",
                  "tpot_speedup", "failures"):
            if k in mat.metadata:
                facts.append(f"{k}={getattr(mat.metadata[k], 'value', mat.metadata[k])}")
    return " ".join(facts)


def run(a: argparse.Namespace) -> dict:
    from dagster import AssetObservation, materialize

    from assets import ALL_ASSETS, ALL_CHECKS
    from assets.sources import fingerprints
    from resources import build_resources
    from resources.instance import project_instance

    if a.data_dir:
        os.environ["EAGLE3_DATA_DIR"] = str(Path(a.data_dir).resolve())
    instance = project_instance(a.dagster_home)
    home = Path(os.environ["DAGSTER_HOME"])
    state = State(home)
    res = build_resources(env=a.env, preset=a.preset, target=a.target)
    target = res["target"]
    log(f"preset={a.preset} target={target.model} env={a.env or os.environ.get('EAGLE3_ENV', 'local')} "
        f"storage={res['storage'].uri('')} DAGSTER_HOME={home}")
    t0 = time.perf_counter()
    tmeta = target.meta()  # prepares (and caches) the target once, before any step needs it
    log(f"target ready: {tmeta['target_id']} ({time.perf_counter() - t0:.1f}s)")
    stop = ORDER.index(a.through)
    chain = [n for n in PARTITIONED if ORDER.index(n) <= stop]
    graph = [*ALL_ASSETS, *ALL_CHECKS]
    base = (a.preset, tmeta["weights_hash"], a.env, os.environ.get("EAGLE3_DATA_DIR"))
    steps, uris, keys = [], {}, []
    fps = fingerprints(a.workloads)
    for w in a.workloads:
        instance.report_runless_asset_event(AssetObservation(
            "workload_sources", partition=w, tags={"dagster/data_version": fps[w]}))
        key = _key(base, w, fps[w], chain)
        keys.append(key)
        steps.append(_step(instance, state, f"partition:{w}", key, a.force, graph, chain, w, res, uris))
    for name in GLOBAL[:max(0, stop - len(PARTITIONED) + 1)]:
        key = _key(base, keys, name, a.workloads)
        keys.append(key)
        steps.append(_step(instance, state, name, key, a.force, graph, [name], None, res, uris))
    wall = time.perf_counter() - t0
    log(f"done in {wall:.1f}s")
    for k, v in sorted(uris.items()):
        print(f"  {k}: {v}", file=sys.stderr)
    return {"preset": a.preset, "target": tmeta["target_id"], "workloads": a.workloads,
            "through": a.through, "steps": steps, "outputs": uris, "wall_s": round(wall, 1),
            "dagster_home": str(home)}


def _outputs(name: str, partition: str | None) -> list[str]:
    """Storage keys that must exist for a step to count as done (state alone can be stale)."""
    from assets.partitions import Keys

    return {"filtered_prompts": lambda: [Keys.kept(partition), Keys.kept(partition, "eval")],
            "target_responses": lambda: [Keys.conversations(partition), Keys.conversations(partition, "eval")],
            "feature_shards": lambda: [f"{Keys.features(partition, s)}/manifest.parquet" for s in ("train", "eval")],
            "draft_vocab": lambda: [f"{Keys.VOCAB}/vocab.safetensors"],
            "draft_head": lambda: [f"{Keys.EXPORT}/config.json", f"{Keys.EXPORT}/model.safetensors"],
            "deployment": lambda: [Keys.DEPLOYMENT],
            "benchmark_report": lambda: [f"{Keys.BENCH}/report/report.md"]}[name]()


def _step(instance, state, step, key, force, graph, selection, partition, res, uris) -> dict:
    from dagster import materialize

    storage = res["storage"]
    have = all(storage.exists(k) for name in selection for k in _outputs(name, partition))
    if not force and have and state.done(step, key):
        log(f"{step}: unchanged since its last success, skipped (--force to rebuild)")
        uris.update(_recorded_uris(instance, selection, partition))
        return {"step": step, "skipped": True}
    t = time.perf_counter()
    log(f"{step}: materializing {' → '.join(selection)}")
    result = materialize(graph, selection=selection, partition_key=partition, instance=instance,
                         resources=res, run_config=RUN_CONFIG, raise_on_error=False,
                         tags={"eagle3/launched_by": "pipeline"})
    dt = time.perf_counter() - t
    if not result.success:
        raise RuntimeError(f"{step} failed after {dt:.0f}s (run {result.run_id}); "
                           f"{_failure(result)} — see `dagster dev -w workspace.yaml` for the run log")
    uris.update(_uris(result, selection))
    for name in selection:
        log(f"{step}: {name} ok {_counts(result, name)}")
    log(f"{step}: done in {dt:.1f}s")
    state.mark(step, key)
    return {"step": step, "seconds": round(dt, 1), "run_id": result.run_id}


def _failure(result) -> str:
    for ev in result.all_events:
        if ev.is_step_failure:
            err = ev.step_failure_data.error
            while err is not None and err.cause is not None:  # the library's own exception, not the wrapper
                err = err.cause
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
