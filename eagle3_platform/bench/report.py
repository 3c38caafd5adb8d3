"""Benchmark report: results.json, report.md, self-contained report.html, PNG plots (matplotlib Agg).

Plots: median TPOT vs concurrency, output throughput vs concurrency, median TTFT vs concurrency
(one line per endpoint: baseline vs EAGLE-3), and τ per workload for the EAGLE-3 endpoint.
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from eagle3_platform.draft.metrics import acceptance_length
from eagle3_platform.store.records import atomic_write

ALL = "all"
PLOTS = {
    "tpot_vs_concurrency.png": ("median_tpot_s", 1000.0, "median TPOT (ms)"),
    "throughput_vs_concurrency.png": ("output_tok_per_s", 1.0, "output tokens/s"),
    "ttft_vs_concurrency.png": ("median_ttft_s", 1000.0, "median TTFT (ms)"),
}
TAU_PLOT = "tau_per_workload.png"
COLUMNS = [("endpoint", None, "{}"), ("concurrency", None, "{}"), ("workload", None, "{}"),
           ("requests", 1, "{:d}"), ("failures", 1, "{:d}"), ("median_ttft_s", 1000, "{:.1f}"),
           ("p90_ttft_s", 1000, "{:.1f}"), ("median_tpot_s", 1000, "{:.1f}"),
           ("output_tok_per_s", 1, "{:.2f}"), ("tau", 1, "{:.2f}"),
           # From the embedded server's /server_info histograms: "-" where not exposed (SGLang).
           ("mean_draft_size", 1, "{:.2f}", "-"), ("mean_batch_size", 1, "{:.2f}", "-")]
HEADERS = ["endpoint", "concurrency", "workload", "requests", "failures", "median TTFT ms",
           "p90 TTFT ms", "median TPOT ms", "output tok/s", "τ", "draft size", "batch size"]


def rows(results: dict, workload: str | None = ALL) -> list[dict]:
    out = []  # by level, the baseline first (the runs alternate which endpoint went first)
    for run in sorted(results["runs"], key=lambda r: (r["concurrency"], r["endpoint"] != "baseline")):
        for w, cell in run["cells"].items():
            if workload is None or w == workload:
                out.append({"endpoint": run["endpoint"], "concurrency": run["concurrency"],
                            "workload": w, **cell})
    return out


def _cell(row: dict, key: str, scale, fmt: str, missing: str = "n/a") -> str:
    v = row.get(key)
    if v is None:
        return missing
    return fmt.format(v * scale if scale not in (None, 1) else v)


def table(rs: list[dict]) -> list[list[str]]:
    return [[_cell(r, *c) for c in COLUMNS] for r in rs]


def plot_metric(results: dict, key: str, scale: float, ylabel: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for ep in sorted({r["endpoint"] for r in results["runs"]}):
        pts = sorted((r["concurrency"], r["cells"][ALL].get(key)) for r in results["runs"]
                     if r["endpoint"] == ep)
        pts = [(c, v * scale) for c, v in pts if v is not None]
        if pts:
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=ep)
    cs = sorted({r["concurrency"] for r in results["runs"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency (users)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tau_per_workload(results: dict, endpoint: str = "eagle3") -> dict[str, float]:
    """τ per workload pooled over all concurrency levels: Σ accepted / Σ verify steps (cells
    without per-request counters, e.g. SGLang, contribute their server-side τ as a plain mean)."""
    pooled: dict[str, list[float]] = {}
    means: dict[str, list[float]] = {}
    for run in results["runs"]:
        if run["endpoint"] != endpoint:
            continue
        for w, cell in run["cells"].items():
            if cell.get("verify_steps"):
                acc = pooled.setdefault(w, [0.0, 0.0])
                acc[0] += cell["accepted_tokens"]
                acc[1] += cell["verify_steps"]
            elif cell.get("tau") is not None:
                means.setdefault(w, []).append(cell["tau"])
    out = {w: acceptance_length(a, s) for w, (a, s) in pooled.items() if s}
    out.update({w: sum(v) / len(v) for w, v in means.items() if w not in out})
    return out


def plot_tau(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vals_by_w = tau_per_workload(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted(vals_by_w, key=lambda w: (w == ALL, w))
    vals = [vals_by_w[w] for w in names]
    ax.bar(names, vals, color="tab:orange")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_ylabel("acceptance length τ")
    ax.set_title("EAGLE-3 acceptance length per workload")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def warm_up_text(cfg: dict) -> str:
    """What each endpoint served before the sweep, unmeasured (bench.run.warm_up)."""
    n, waves = cfg.get("warmup_requests", 0), cfg.get("warmup_waves", 0)
    levels = [c for c in cfg["concurrency"] if c > 1] if waves else []
    text = f"{n} warm-up requests per endpoint"
    if levels:
        text += f", then {waves} wave{'s' if waves > 1 else ''} of c requests at once at c = {levels}"
    return text + " before the sweep (not measured)"


def markdown(results: dict, plots: list[str]) -> str:
    h = results.get("headline", {})
    cfg = results["config"]
    lines = ["# EAGLE-3 benchmark report", "",
             f"Prompts: `{cfg['prompts']}` ({cfg['n_prompts']} records; workloads: "
             f"{', '.join(cfg['workloads'])}); max_tokens {cfg['max_tokens']}; "
             f"{cfg['duration_s']} s per cell; concurrency {cfg['concurrency']}; "
             f"{warm_up_text(cfg)}.",
             "",
             "Endpoints: " + ", ".join(f"{k} = {v}" for k, v in cfg["endpoints"].items()), "",
             "## Headline", ""]
    for k, v in h.items():
        lines.append(f"- **{k}**: {_fmt(v)}")
    taus = tau_per_workload(results)
    if taus:
        lines += ["", "τ per workload (EAGLE-3, pooled over concurrency): " +
                  ", ".join(f"{w} {t:.2f}" for w, t in sorted(taus.items()))]
    lines += ["", "## All workloads", "", *_md_table(table(rows(results)))]
    per_w = [r for r in rows(results, None) if r["workload"] != ALL]
    if per_w:
        lines += ["", "## Per workload", "", *_md_table(table(per_w))]
    lines += ["", "TPOT = (latency − TTFT) / (output tokens − 1); τ = accepted tokens / verify "
              "steps (SGLang's avg_spec_accept_length definition); draft size and batch size = "
              "mean draft tokens the server chose and mean running requests per decode step "
              "(server-wide, so in the all-workloads rows only; - where the server does not "
              "expose them).", ""]
    servers = (results.get("servers") or {}).values()
    if any(i and "max_queue" in i and "batch_size_hist" not in i for i in servers):
        lines += ["The embedded CPU server decodes one request at a time (FIFO queue): at higher "
                  "concurrency requests wait in the queue, which shows in TTFT rather than TPOT, "
                  "and output throughput stays roughly flat.", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _md_table(body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS),
            *["| " + " | ".join(r) + " |" for r in body]]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"c={k}: {x:.2f}×" for k, x in v.items())
    return str(v)


def html_report(results: dict, out_dir: Path, plots: list[str]) -> str:
    def tab(body):
        head = "".join(f"<th>{html.escape(x)}</th>" for x in HEADERS)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                      for r in body)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>"

    imgs = "".join(
        f'<figure><img alt="{p}" src="data:image/png;base64,'
        f'{base64.b64encode((out_dir / p).read_bytes()).decode()}"/><figcaption>{p}</figcaption>'
        "</figure>" for p in plots)
    head = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(_fmt(v))}</li>"
                   for k, v in results.get("headline", {}).items())
    per_w = [r for r in rows(results, None) if r["workload"] != ALL]
    cfg = html.escape(json.dumps(results["config"], indent=1))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>EAGLE-3 benchmark</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
            "figure{display:inline-block;margin:1em}</style></head><body>"
            "<h1>EAGLE-3 benchmark report</h1>"
            f"<h2>Headline</h2><ul>{head}</ul><h2>All workloads</h2>{tab(table(rows(results)))}"
            + (f"<h2>Per workload</h2>{tab(table(per_w))}" if per_w else "")
            + f"<h2>Plots</h2>{imgs}<h2>Config</h2><pre>{cfg}</pre></body></html>")


def write_report(results: dict, out_dir: str | Path) -> dict:
    """Writes plots, report.md, report.html and results.json; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, (key, scale, label) in PLOTS.items():
        plot_metric(results, key, scale, label, out_dir / name)
        plots.append(name)
    if any(r["endpoint"] == "eagle3" for r in results["runs"]):
        plot_tau(results, out_dir / TAU_PLOT)
        plots.append(TAU_PLOT)
    files = {"results": str(out_dir / "results.json"), "markdown": str(out_dir / "report.md"),
             "html": str(out_dir / "report.html"), "plots": [str(out_dir / p) for p in plots]}
    for name, text in (("report.md", markdown(results, plots)),
                       ("report.html", html_report(results, out_dir, plots)),
                       ("results.json", json.dumps({**results, "files": files}, indent=2, default=str))):
        atomic_write(out_dir / name, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
    return files
