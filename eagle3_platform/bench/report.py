"""Benchmark report: results.json, report.md, self-contained report.html, PNG plots (matplotlib Agg).

Plots: median TPOT vs concurrency, output throughput vs concurrency, median TTFT vs concurrency
(one line per endpoint: baseline vs EAGLE-3), the EAGLE-3/baseline speedup vs concurrency, and τ
per workload per concurrency level for the EAGLE-3 endpoint. The header names the target, head,
spec preset (from the servers' /server_info), hardware, date and git commit (run.environment).
"""
from __future__ import annotations

import base64
import html
import json
import re
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
SPEEDUP_PLOT = "speedup_vs_concurrency.png"
COLUMNS = [("endpoint", None, "{}"), ("concurrency", None, "{}"), ("workload", None, "{}"),
           ("requests", 1, "{:d}"), ("failures", 1, "{:d}"), ("median_ttft_s", 1000, "{:.1f}"),
           ("p90_ttft_s", 1000, "{:.1f}"), ("median_tpot_s", 1000, "{:.1f}"),
           ("p10_tpot_s", 1000, "{:.1f}"), ("p90_tpot_s", 1000, "{:.1f}"),
           ("output_tok_per_s", 1, "{:.2f}"), ("tau", 1, "{:.2f}"),
           # From the embedded server's /server_info histograms: "-" where not exposed (SGLang).
           ("mean_draft_size", 1, "{:.2f}", "-"), ("mean_batch_size", 1, "{:.2f}", "-")]
HEADERS = ["endpoint", "concurrency", "workload", "requests", "failures", "median TTFT ms",
           "p90 TTFT ms", "median TPOT ms", "p10 TPOT ms", "p90 TPOT ms", "output tok/s", "τ", "draft size", "batch size"]


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


def _figure(figsize):
    """(fig, ax) on the file-only backend (no display in a server or a Dagster step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_metric(results: dict, key: str, scale: float, ylabel: str, path: Path) -> None:
    fig, ax = _figure(figsize=(6, 4))
    for ep in sorted({r["endpoint"] for r in results["runs"]}):
        pts = sorted((r["concurrency"], r["cells"][ALL].get(key)) for r in results["runs"]
                     if r["endpoint"] == ep)
        pts = [(c, v * scale) for c, v in pts if v is not None]
        if pts:
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=ep)
    _log2_axis(ax, sorted({r["concurrency"] for r in results["runs"]}))
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} vs concurrency")
    ax.legend()
    _save(fig, path)


def tau_per_level(results: dict, endpoint: str = "eagle3") -> dict[str, dict[int, float]]:
    """{workload: {concurrency: τ}} of one endpoint. Levels are kept apart: batching changes what the
    server drafts, so a τ pooled over levels hides that c = 1 accepts more than c = 8."""
    out: dict[str, dict[int, float]] = {}
    for run in sorted(results["runs"], key=lambda r: r["concurrency"]):
        if run["endpoint"] != endpoint:
            continue
        for w, cell in run["cells"].items():
            tau = (acceptance_length(cell["accepted_tokens"], cell["verify_steps"])
                   if cell.get("verify_steps") else cell.get("tau"))
            if tau is not None:
                out.setdefault(w, {})[run["concurrency"]] = tau
    return out


def speedups(results: dict) -> dict[int, dict[str, float | None]]:
    """Per concurrency (ascending): baseline / EAGLE-3 median TPOT (> 1: EAGLE-3 faster per token) and
    EAGLE-3 / baseline output throughput, over the all-workloads cells."""
    cells = {(r["endpoint"], r["concurrency"]): r["cells"][ALL] for r in results["runs"]}
    out = {}
    for c in sorted({c for ep, c in cells if ep == "eagle3"}):
        b, e = cells.get(("baseline", c)), cells[("eagle3", c)]
        if b is None:
            continue
        out[c] = {"tpot_speedup": _ratio(b.get("median_tpot_s"), e.get("median_tpot_s")),
                  "throughput_ratio": _ratio(e.get("output_tok_per_s"), b.get("output_tok_per_s"))}
    return out


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def _log2_axis(ax, cs: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (users)")
    ax.grid(True, alpha=0.3)


def plot_speedup(results: dict, path: Path) -> bool:
    """EAGLE-3 vs baseline ratios per concurrency; False (no file) without a baseline."""
    sp = speedups(results)
    if not sp:
        return False
    fig, ax = _figure(figsize=(6, 4))
    for key, label in (("tpot_speedup", "TPOT speedup (baseline / EAGLE-3)"),
                       ("throughput_ratio", "throughput ratio (EAGLE-3 / baseline)")):
        pts = [(c, v[key]) for c, v in sp.items() if v[key] is not None]
        if pts:
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=label)
            for c, v in pts:
                ax.annotate(f"{v:.2f}×", (c, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    _log2_axis(ax, list(sp))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ratio (×, > 1: EAGLE-3 better)")
    ax.set_title("EAGLE-3 speedup vs concurrency")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def plot_tau(results: dict, path: Path) -> None:
    """Grouped bars: τ per workload, one bar per concurrency level."""
    taus = tau_per_level(results)
    names = sorted(taus, key=lambda w: (w == ALL, w))
    levels = sorted({c for v in taus.values() for c in v})
    width = 0.8 / max(1, len(levels))
    fig, ax = _figure(figsize=(max(6, 1.2 * len(names) * max(1, len(levels)) / 2), 4))
    for j, c in enumerate(levels):
        xs = [i + (j - (len(levels) - 1) / 2) * width for i, w in enumerate(names) if c in taus[w]]
        vs = [taus[w][c] for w in names if c in taus[w]]
        ax.bar(xs, vs, width=width, label=f"c = {c}")
        for x, v in zip(xs, vs):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_ylabel("acceptance length τ (tokens per verify step)")
    ax.set_title("EAGLE-3 acceptance length per workload and concurrency")
    ax.legend(fontsize=8)
    _save(fig, path)


def header_facts(results: dict) -> dict[str, str]:
    """What was measured on what: target, head, spec preset, hardware, date, commit ('unknown' where
    a server or the environment did not say)."""
    info = (results.get("servers") or {}).get("eagle3") or {}
    env = results.get("environment") or {}
    head = "none" if not info.get("draft", True) else head_identity(info)
    cpu = f"{env['cpu']} ({env['cpus']} cores)" if env.get("cpu") and env.get("cpus") else env.get("cpu")
    hw = ", ".join(x for x in (cpu, env.get("gpu")) if x)
    return {"target": str(info.get("target_id") or info.get("model_path") or info.get("model") or "unknown"),
            "head": head, "preset": str(info.get("spec") or "unknown"), "hardware": hw or "unknown",
            "date": str(env.get("date") or "unknown"), "commit": str(env.get("commit") or "unknown")}


def head_context(results: dict) -> str | None:
    """What the EAGLE-3 server's head attends when it drafts (its /server_info settings; SGLang's
    worker: the whole prefix), None where no head was served or the server does not say."""
    info = (results.get("servers") or {}).get("eagle3") or {}
    if not info.get("draft", True):
        return None
    if ctx := (info.get("spec_config") or {}).get("head_context"):
        return str(ctx)
    return "whole prefix" if info.get("speculative_algorithm") else None


def head_context_line(ctx: str) -> str:
    same = ctx == "whole prefix"  # what SGLang's EAGLE-3 worker drafts over
    return f"Head context: {ctx}" + (" (as SGLang's EAGLE-3 worker: τ here is what this head gives in SGLang)."
                                     if same else " (SGLang's head attends the whole prefix: its τ may differ).")


def head_identity(info: dict) -> str:
    """Which head was served: the sha256 of its weights (the embedded server's), else the draft path
    SGLang names, then how it ran (head weights, dtype)."""
    how = " ".join(str(x) for x in (info.get("head_weights"), info.get("dtype")) if x)
    sha, path = info.get("head_sha256"), info.get("speculative_draft_model_path")
    ident = f"sha256 {sha[:12]}" if sha else (Path(str(path)).name if path else "")
    if ident and how:
        return f"{ident} ({how})"
    return ident or how or "EAGLE-3 draft"


def _md_tau(results: dict) -> list[str]:
    taus = tau_per_level(results)
    levels = sorted({c for v in taus.values() for c in v})
    if not taus:
        return []
    return ["| workload | " + " | ".join(f"τ at c = {c}" for c in levels) + " |", "|---|" + "---|" * len(levels),
            *[f"| {w} | " + " | ".join(f"{taus[w][c]:.2f}" if c in taus[w] else "n/a" for c in levels) + " |"
              for w in sorted(taus, key=lambda w: (w == ALL, w))]]


def _md_speedups(results: dict) -> list[str]:
    sp = speedups(results)
    f = lambda v: "n/a" if v is None else f"{v:.2f}×"  # noqa: E731
    return (["| concurrency | TPOT speedup (baseline / EAGLE-3) | throughput ratio (EAGLE-3 / baseline) |",
             "|---|---|---|", *[f"| {c} | {f(v['tpot_speedup'])} | {f(v['throughput_ratio'])} |" for c, v in sp.items()]]
            if sp else [])


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
    facts = header_facts(results)
    lines = ["# EAGLE-3 benchmark report", "",
             " · ".join(f"**{k}**: {v}" for k, v in facts.items()), "",
             *([head_context_line(ctx), ""] if (ctx := head_context(results)) else []),
             # the prompts file by name: the path is the run's scratch dir, gone once it is published
             f"Prompts: `{Path(cfg['prompts']).name}` ({cfg['n_prompts']} records; workloads: "
             f"{', '.join(cfg['workloads'])}); max_tokens {cfg['max_tokens']}; "
             f"{cfg['duration_s']} s per cell; concurrency {cfg['concurrency']}; "
             f"{warm_up_text(cfg)}.",
             "",
             "Endpoints: " + ", ".join(f"{k} = {v}" for k, v in cfg["endpoints"].items()), "",
             "## Headline", ""]
    for k, v in h.items():
        lines.append(f"- **{k}**: {_fmt(v)}")
    if sp := _md_speedups(results):
        lines += ["", "## Speedup per concurrency", "", *sp]
    if tau := _md_tau(results):
        lines += ["", "## τ per workload and concurrency (EAGLE-3)", "", *tau]
    lines += ["", "## All workloads", "", *_md_table(table(rows(results)))]
    per_w = [r for r in rows(results, None) if r["workload"] != ALL]
    if per_w:
        lines += ["", "## Per workload", "", *_md_table(table(per_w))]
    lines += ["", "TPOT = (latency − TTFT) / (output tokens − 1), its spread p10–p90 over the cell's "
              "requests; τ = accepted tokens / verify "
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


def inline_images(md: str, out_dir: str | Path) -> str:
    """report.md with its relative PNG links replaced by data: URIs (for viewers, such as Dagster's
    UI, that cannot resolve a link relative to the report's directory)."""
    out_dir = Path(out_dir)

    def src(m: re.Match) -> str:
        p = out_dir / m.group(2)
        if not p.is_file():
            return m.group(0)
        return f"![{m.group(1)}](data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(([\w.-]+\.png)\)", src, md)


def _md_table(body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS),
            *["| " + " | ".join(r) + " |" for r in body]]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"c={k}: {x:.2f}×" for k, x in sorted(v.items(), key=lambda kv: int(kv[0])))
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
    facts = " · ".join(f"<b>{html.escape(k)}</b>: {html.escape(v)}" for k, v in header_facts(results).items())
    context = f"<p>{html.escape(head_context_line(ctx))}</p>" if (ctx := head_context(results)) else ""
    extra = "".join(f"<h2>{title}</h2>{_md_to_html_table(md)}" for title, md in (
        ("Speedup per concurrency", _md_speedups(results)),
        ("τ per workload and concurrency (EAGLE-3)", _md_tau(results))) if md)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>EAGLE-3 benchmark</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
            "figure{display:inline-block;margin:1em}</style></head><body>"
            "<h1>EAGLE-3 benchmark report</h1>"
            f"<p>{facts}</p>{context}"
            f"<h2>Headline</h2><ul>{head}</ul>{extra}<h2>All workloads</h2>{tab(table(rows(results)))}"
            + (f"<h2>Per workload</h2>{tab(table(per_w))}" if per_w else "")
            + f"<h2>Plots</h2>{imgs}<h2>Config</h2><pre>{cfg}</pre></body></html>")


def _md_to_html_table(md_lines: list[str]) -> str:
    """One of this module's own markdown tables (header, rule, rows) as an HTML table."""
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in md_lines]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in cells[2:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(results: dict, out_dir: str | Path) -> dict:
    """Writes plots, report.md, report.html and results.json; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, (key, scale, label) in PLOTS.items():
        plot_metric(results, key, scale, label, out_dir / name)
        plots.append(name)
    if plot_speedup(results, out_dir / SPEEDUP_PLOT):
        plots.append(SPEEDUP_PLOT)
    if any(r["endpoint"] == "eagle3" for r in results["runs"]):
        plot_tau(results, out_dir / TAU_PLOT)
        plots.append(TAU_PLOT)
    files = {"results": str(out_dir / "results.json"), "markdown": str(out_dir / "report.md"),
             "html": str(out_dir / "report.html"), "plots": [str(out_dir / p) for p in plots]}
    for name, text in (("report.md", markdown(results, plots)),
                       ("report.html", html_report(results, out_dir, plots)),
                       ("results.json", json.dumps({**results, "files": _names(files, out_dir)}, indent=2,
                                                   default=str))):
        atomic_write(out_dir / name, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
    return files


def _names(files: dict, out_dir: Path) -> dict:
    """The report's files as results.json records them: relative to its own directory, which moves
    when a run's scratch directory is published (an absolute path there would name a file gone)."""
    rel = lambda f: str(Path(f).relative_to(out_dir))  # noqa: E731
    return {k: [rel(f) for f in v] if isinstance(v, list) else rel(v) for k, v in files.items()}
