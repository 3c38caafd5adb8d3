"""`benchmark_report`: Locust sweep over concurrency, baseline vs EAGLE-3, on held-out prompts.

Locust monkey-patches sockets (gevent), so it never runs inside Dagster's process: the asset starts
both endpoints, then runs `eagle3 bench` as its own process and publishes the report directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dagster import (AssetExecutionContext, MaterializeResult, MetadataValue, TableColumn, TableRecord, TableSchema,
                     asset)

from eagle3_platform.cli.summary import run_with_summary
from eagle3_platform.progress import parse as parse_progress

from assets.deploy import deployment, servers
from assets.metadata import OWNERS, dict_table, location, png_markdown, rounded, summary_metadata
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


def bench_args(cfg, url: str, baseline: str, prompts, out, duration_s: int | None = None,
               preset: str = "demo") -> list[str]:
    """`eagle3 bench` argv from the preset's BenchConfig (duration_s, when given, overrides it); the
    warm-up and stop timeout the command reads from the preset itself."""
    return ["bench", "--url", url, "--baseline-url", baseline, "--prompts", str(prompts), "--out", str(out),
            "--concurrency", ",".join(map(str, cfg.concurrency)), "--duration", str(duration_s or cfg.duration_s),
            "--max-tokens", str(cfg.max_tokens), "--preset", preset]


@asset(deps=[deployment], group_name="serving", kinds={"locust"}, owners=OWNERS)
def benchmark_report(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                     serving: ServingResource, preset: PresetResource) -> MaterializeResult:
    """Baseline vs EAGLE-3 under a Locust concurrency sweep on the held-out prompts: TPOT, TTFT,
    throughput and speedup per concurrency, τ per workload; the report and its plots on this page."""
    export = storage.fetch_dir(Keys.EXPORT)
    out = storage.staging(Keys.BENCH, context.run.run_id)
    counts = heldout_prompts(storage, out / "prompts.jsonl")
    tdir = target.dir()
    # side by side (the sweep alternates between them), started one after the other; on SGLang each
    # holds serving.bench_mem_fraction_static of the GPUs' memory, so both fit
    registry = servers(storage)  # both die with this step; a killed run's are stopped by the next start
    base = serving.launch(tdir, None, log_path=out / "baseline.log", preset=preset.name,
                          port=serving.baseline_port, compute=preset.compute(), shared=True,
                          registry=registry, role="bench-baseline")
    try:
        spec = serving.launch(tdir, export, log_path=out / "eagle3.log", preset=preset.name,
                              compute=preset.compute(), shared=True, registry=registry, role="bench-eagle3")
        try:
            args = bench_args(preset.area("bench"), spec.url, base.url, out / "prompts.jsonl",
                              out / "report", serving.bench_duration_s, preset.name)
            summary = _run_cli(context, args, serving.api_key)
        finally:
            spec.stop()
    finally:
        base.stop()
    report = report_metadata(out / "report", storage.uri(Keys.BENCH))  # read before publishing moves it
    storage.publish_from(out, Keys.BENCH)
    return MaterializeResult(metadata={**report,
                                       "heldout_prompts": dict_table(counts, "workload", "prompts"),
                                       **target.lineage(), **summary_metadata(_headline(summary))})


def _headline(summary: dict) -> dict:
    """The CLI summary's headline, less what report_metadata shows as tables (per-concurrency ratios)."""
    return {k: v for k, v in (summary.get("headline") or {}).items() if v is not None and not isinstance(v, dict)}


# The plots shown on the asset page, each its own entry (in this order), from eagle3_platform.bench.report.
PLOT_ENTRIES = {"plot_tpot": "tpot_vs_concurrency.png", "plot_throughput": "throughput_vs_concurrency.png",
                "plot_ttft": "ttft_vs_concurrency.png", "plot_speedup": "speedup_vs_concurrency.png",
                "plot_tau": "tau_per_workload.png"}
CELL_COLUMNS = [("endpoint", "string"), ("concurrency", "int"), ("requests", "int"), ("failures", "int"),
                ("median_ttft_ms", "float"), ("median_tpot_ms", "float"), ("p10_tpot_ms", "float"),
                ("p90_tpot_ms", "float"), ("output_tok_per_s", "float"), ("tau", "float")]


def report_metadata(report_dir: Path, uri: str) -> dict:
    """The published report as the asset page shows it: each plot inline (PNG data URIs), the report's
    text with its plots inline, the cells and speedups as typed tables (concurrency ascending), and
    where the report files lie (`uri`: the published copy of the run's directory)."""
    from eagle3_platform.bench.report import inline_images, speedups, tau_per_level

    results = json.loads((report_dir / "results.json").read_text())
    meta = {name: png_markdown({file: (report_dir / file).read_bytes()})
            for name, file in PLOT_ENTRIES.items() if (report_dir / file).is_file()}
    md = report_dir / "report.md"
    meta["report"] = MetadataValue.md(inline_images(md.read_text(), report_dir) if md.exists() else "(no report.md)")
    meta["cells"] = MetadataValue.table([TableRecord(_cell_record(r)) for r in sorted(
        results["runs"], key=lambda r: (r["concurrency"], r["endpoint"] != "baseline"))],
        schema=TableSchema(columns=[TableColumn(n, t) for n, t in CELL_COLUMNS]))
    sp = speedups(results)
    meta["speedup_by_concurrency"] = MetadataValue.table(
        [TableRecord({"concurrency": c, "tpot_speedup": _num(r["tpot_speedup"]),
                      "throughput_ratio": _num(r["throughput_ratio"])}) for c, r in sp.items()],
        schema=TableSchema(columns=[TableColumn("concurrency", "int"), TableColumn("tpot_speedup", "float"),
                                    TableColumn("throughput_ratio", "float")]))
    taus = tau_per_level(results)
    levels = sorted({c for v in taus.values() for c in v})
    meta["tau_by_workload"] = MetadataValue.table(
        [TableRecord({"workload": w, **{f"c{c}": _num(v.get(c)) for c in levels}}) for w, v in taus.items()],
        schema=TableSchema(columns=[TableColumn("workload", "string"),
                                    *[TableColumn(f"c{c}", "float", description=f"τ at concurrency {c}")
                                      for c in levels]]))
    meta.update({"report_uri": location(f"{uri}/report/report.md"),
                 "report_html_uri": location(f"{uri}/report/report.html")})
    return meta


def _cell_record(run: dict) -> dict:
    """Every column in every row (Dagster's tables need one set of fields): None where a cell has no
    value, e.g. a level at which a slow box finished no request of a workload."""
    a = run["cells"]["all"]
    ms = {f"{k}_ms": _num(a.get(f"{k}_s"), 1000) for k in ("median_ttft", "median_tpot", "p10_tpot", "p90_tpot")}
    return {"endpoint": run["endpoint"], "concurrency": run["concurrency"], "requests": a.get("requests", 0),
            "failures": a.get("failures", 0), **ms, **{k: _num(a.get(k)) for k in ("output_tok_per_s", "tau")}}


def _num(v: float | None, scale: float = 1.0) -> float | None:
    return None if v is None else rounded(v * scale)


def _run_cli(context, args: list[str], api_key: str | None = None) -> dict:
    """`eagle3 <args>` in its own process (output streamed to the run log); returns its JSON summary."""
    context.log.info("eagle3 " + " ".join(args))
    env = {**os.environ, **({"EAGLE3_API_KEY": api_key} if api_key else {})}  # not on the command line
    rc, summary = run_with_summary([sys.executable, "-m", "eagle3_platform.cli", *args], cwd=PROJECT_ROOT, env=env,
                                   stderr=subprocess.STDOUT, echo=lambda line: _echo(context, line))
    if not summary["ok"]:
        raise RuntimeError(f"eagle3 {args[0]} failed (exit {rc}): {summary['error']}")
    return summary


def _echo(context, line: str) -> None:
    """The command's output on this step's stdout; its progress lines (eagle3_platform.progress: the
    sweep's cells done of all) in the run's log too, where the UI shows them."""
    print(line, end="", flush=True)
    if parse_progress(line):
        context.log.info(line.rstrip("\n"))
