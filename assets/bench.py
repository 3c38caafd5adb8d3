"""`benchmark_report`: Locust sweep over concurrency, baseline vs EAGLE-3, on held-out prompts.

Locust monkey-patches sockets (gevent), so it never runs inside Dagster's process: the asset starts
both endpoints, then runs `eagle3 bench` as its own process and publishes the report directory."""

import os
import subprocess
import sys

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from eagle3_platform.cli.summary import run_with_summary

from assets.deploy import deployment
from assets.metadata import summary_metadata
from assets.partitions import Keys, workload_partitions
from resources import PresetResource, ServingResource, StorageResource, TargetResource
from resources.storage import PROJECT_ROOT


def heldout_prompts(storage: StorageResource, out) -> dict:
    """All held-out (eval split) prompt records of the available workloads, in one JSONL file."""
    counts = {}
    with open(out, "w") as f:
        for w in workload_partitions.get_partition_keys():
            key = Keys.kept(w, "eval")
            if storage.exists(key):
                lines = [ln for ln in storage.fetch(key).read_text().splitlines() if ln.strip()]
                f.write("".join(ln + "\n" for ln in lines))
                counts[w] = len(lines)
    if not counts:
        raise FileNotFoundError("no held-out prompts in storage: materialize filtered_prompts first")
    return counts


def bench_args(cfg, url: str, baseline: str, prompts, out, duration_s: int | None = None) -> list[str]:
    """`eagle3 bench` argv from the preset's BenchConfig (duration_s, when given, overrides it)."""
    return ["bench", "--url", url, "--baseline-url", baseline, "--prompts", str(prompts), "--out", str(out),
            "--concurrency", ",".join(map(str, cfg.concurrency)), "--duration", str(duration_s or cfg.duration_s),
            "--max-tokens", str(cfg.max_tokens), "--warmup-requests", str(cfg.warmup_requests),
            "--warmup-waves", str(cfg.warmup_waves)]


@asset(deps=[deployment], group_name="serving", kinds={"locust"})
def benchmark_report(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                     serving: ServingResource, preset: PresetResource) -> MaterializeResult:
    export = storage.fetch_dir(Keys.EXPORT)
    out = storage.staging(Keys.BENCH, context.run.run_id)
    counts = heldout_prompts(storage, out / "prompts.jsonl")
    tdir = target.dir()
    base = serving.launch(tdir, None, log_path=out / "baseline.log", preset=preset.name,
                          port=serving.baseline_port, compute=preset.compute())
    try:
        spec = serving.launch(tdir, export, log_path=out / "eagle3.log", preset=preset.name,
                              compute=preset.compute())
        try:
            args = bench_args(preset.area("bench"), spec.url, base.url, out / "prompts.jsonl",
                              out / "report", serving.bench_duration_s)
            summary = _run_cli(context, args, serving.api_key)
        finally:
            spec.stop()
    finally:
        base.stop()
    report_md = out / "report" / "report.md"
    md = report_md.read_text() if report_md.exists() else "(no report.md)"
    uri = storage.publish_from(out, Keys.BENCH)
    return MaterializeResult(metadata={
        "report": MetadataValue.md(md), "report_uri": MetadataValue.path(f"{uri}/report/report.md"),
        "report_html_uri": MetadataValue.path(f"{uri}/report/report.html"),
        "heldout_prompts": MetadataValue.json(counts), **target.lineage(),
        **summary_metadata({k: v for k, v in (summary.get("headline") or {}).items() if v is not None})})


def _run_cli(context, args: list[str], api_key: str | None = None) -> dict:
    """`eagle3 <args>` in its own process (output streamed to the run log); returns its JSON summary."""
    context.log.info("eagle3 " + " ".join(args))
    env = {**os.environ, **({"EAGLE3_API_KEY": api_key} if api_key else {})}  # not on the command line
    rc, summary = run_with_summary([sys.executable, "-m", "eagle3_platform.cli", *args], cwd=PROJECT_ROOT, env=env,
                                   stderr=subprocess.STDOUT, echo=lambda line: print(line, end="", flush=True))
    if not summary["ok"]:
        raise RuntimeError(f"eagle3 {args[0]} failed (exit {rc}): {summary['error']}")
    return summary
