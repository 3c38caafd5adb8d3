"""Concurrency sweep: one real headless Locust process per (endpoint, concurrency).

Locust is never imported here (gevent monkey-patches sockets on import); it runs as
`python -m locust -f locustfile.py --headless ...` in its own process. Around each run the endpoint's
/server_info is snapshotted so τ can be taken from the counters' delta. Endpoints are interleaved
per concurrency level (baseline c=1, eagle3 c=1, eagle3 c=2, baseline c=2, …) so slow drift of a
shared, noisy machine hits both alike: who goes first alternates, so a box that slows (or speeds up)
through the sweep favours neither endpoint at every level.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from eagle3_platform.bench.metrics import aggregate, hist_between, tau_between, wall_time
from eagle3_platform.bench.prompts import prompt_messages
from eagle3_platform.progress import report as report_progress
from eagle3_platform.store.records import read_jsonl, write_jsonl_atomic

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
ALL = "all"
INFO_TIMEOUT_S = 10.0
# Requests each endpoint serves before its first measured cell, one at a time at the sweep's
# max_tokens: lazy initialisation, and the EAGLE-3 server's draft-size policy's first exploration at
# batch 1 (spec/policy.py: it starts drafting at its largest size and learns down). Unwarmed, the
# c = 1 cell measures the policy's start (below plain decoding), not the server a user keeps running.
WARMUP_REQUESTS = 4
# Then, per endpoint and concurrency level c > 1, this many waves of c requests sent at once: the
# policy keeps its costs per batch-size bucket, so each level's one cell otherwise paid that bucket's
# first exploration (drafting at the nearest bucket's size before any cost there was measured): the
# first cell at a level read ~0.9x the baseline's tok/s where the cells after read ~1.03x.
WARMUP_WAVES = 1


@dataclass(frozen=True)
class BenchConfig:
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    duration_s: int = 30
    max_tokens: int = 64
    stop_timeout_s: int | None = None   # in-flight requests may finish; None = duration_s
    warmup_requests: int = WARMUP_REQUESTS  # per endpoint, before the sweep, not measured (0 = none)
    warmup_waves: int = WARMUP_WAVES        # per endpoint and level c > 1: waves of c requests at once
    slack_s: int = 120                  # Locust start-up/shut-down allowance on a busy machine


PRESETS: dict[str, BenchConfig] = {
    "tiny": BenchConfig(concurrency=(1, 2), duration_s=4, max_tokens=16),
    # 5 levels x 2 endpoints x 24 s: the same measured time as the former 4 x 2 x 30 s, so adding
    # c=16 does not lengthen `eagle3 run --preset demo`.
    "demo": BenchConfig(concurrency=(1, 2, 4, 8, 16), duration_s=24, max_tokens=64),
    "cpu": BenchConfig(concurrency=(1, 2, 4, 8, 16), duration_s=30, max_tokens=64),
    "full": BenchConfig(concurrency=(1, 2, 4, 8, 16, 32, 64), duration_s=120, max_tokens=256),
}


def default_workload(rec: dict) -> str:
    return rec.get("workload") or ALL


def server_info(url: str, api_key: str | None) -> dict | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpx.get(url.rstrip("/") + path, headers=headers, timeout=INFO_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        if r.status_code == 200:
            return r.json()
    return None


def warm_up(url: str, api_key: str | None, rows: list[dict], n: int, max_tokens: int,
            levels: tuple[int, ...] = (), waves: int = 0) -> None:
    """n requests, one at a time, then for each level c in `levels` `waves` waves of c requests sent at
    once (the rows' prompts in order, cycled), so lazy initialisation and a policy's first exploration at
    each batch size are not billed to the measured cells (WARMUP_REQUESTS, WARMUP_WAVES)."""
    prompts = itertools.cycle(rows)
    for _ in range(n):
        _warm_request(url, api_key, next(prompts), max_tokens)
    for c in levels:
        for _ in range(waves):
            wave = [next(prompts) for _ in range(c)]
            with ThreadPoolExecutor(c) as pool:  # a failed request raises here, naming the endpoint
                list(pool.map(lambda row: _warm_request(url, api_key, row, max_tokens), wave))


def _warm_request(url: str, api_key: str | None, row: dict, max_tokens: int) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"messages": prompt_messages(row), "max_tokens": max_tokens, "temperature": 0.0}
    try:
        r = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers, timeout=600)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request to {url} failed: HTTP {r.status_code} {r.text[:300]}")


def locust_command(url: str, concurrency: int, cfg: BenchConfig, csv_prefix: Path) -> list[str]:
    stop_timeout = cfg.stop_timeout_s if cfg.stop_timeout_s is not None else cfg.duration_s
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", str(concurrency), "-r", str(concurrency), "--run-time", f"{cfg.duration_s}s",
            "--host", url, "--only-summary", "--stop-timeout", str(stop_timeout),
            "--csv", str(csv_prefix)]


def run_locust(url: str, label: str, concurrency: int, prompts_path: Path, cfg: BenchConfig,
               out_dir: Path, api_key: str | None) -> list[dict]:
    stem = f"{label}_c{concurrency}"
    req_path = out_dir / "requests" / f"{stem}.jsonl"
    req_path.parent.mkdir(parents=True, exist_ok=True)
    req_path.unlink(missing_ok=True)
    env = {**os.environ, "EAGLE3_BENCH_PROMPTS": str(prompts_path), "EAGLE3_BENCH_OUT": str(req_path),
           "EAGLE3_BENCH_MAX_TOKENS": str(cfg.max_tokens), "EAGLE3_BENCH_LABEL": label,
           "EAGLE3_BENCH_CONCURRENCY": str(concurrency)}
    env.pop("EAGLE3_API_KEY", None)
    if api_key:
        env["EAGLE3_API_KEY"] = api_key
    cmd = locust_command(url, concurrency, cfg, out_dir / "locust" / stem)
    (out_dir / "locust").mkdir(parents=True, exist_ok=True)
    timeout = cfg.duration_s + (cfg.stop_timeout_s or cfg.duration_s) + cfg.slack_s
    with open(out_dir / "locust" / f"{stem}.log", "wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    # Locust exits 1 when any request failed; failures are counted from the records instead.
    if proc.returncode not in (0, 1):
        tail = (out_dir / "locust" / f"{stem}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"locust exited with {proc.returncode} for {stem}:\n{tail}")
    recs = list(read_jsonl(req_path, tolerate_torn_tail=True)) if req_path.exists() else []
    log_text = (out_dir / "locust" / f"{stem}.log").read_text(errors="replace")
    if not recs and "All users spawned" not in log_text:  # Locust itself never got going
        raise RuntimeError(f"locust did not start for {stem} (exit {proc.returncode}); log tail:\n"
                           f"{log_text[-2000:]}")
    if not recs:  # a slow endpoint: the cell stays (empty, flagged) and the sweep goes on
        print(f"[bench] WARNING: no request finished for {stem} within the run + stop timeout; "
              "a longer --duration (or BenchConfig.stop_timeout_s) is needed", file=sys.stderr, flush=True)
    return recs


def summarize(records: list[dict], workloads: list[str]) -> dict[str, dict]:
    """Per-workload cells plus the 'all' cell; throughput uses the whole run's wall time."""
    wall = wall_time(records)
    cells = {ALL: aggregate(records, wall)}
    for w in sorted(set(workloads)):
        rows = [r for r in records if r["workload"] == w]
        if rows and w != ALL:
            cells[w] = aggregate(rows, wall)
    return cells


def run_benchmark(url: str, prompts_path: str | Path, concurrency=(1, 2, 4, 8),
                  duration_s: int = 30, out_dir: str | Path = "bench_out",
                  baseline_url: str | None = None, api_key: str | None = None,
                  workload_of_prompt: Callable[[dict], str] = default_workload,
                  max_tokens: int = 64, stop_timeout_s: int | None = None,
                  warmup_requests: int = WARMUP_REQUESTS, write_report: bool = True,
                  max_prompt_chars: int | None = None, warmup_waves: int = WARMUP_WAVES) -> dict:
    """Sweep concurrency on each endpoint; returns (and writes) results.json's content."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = Path(prompts_path)
    rows, skipped = select_prompts(list(read_jsonl(source)), max_prompt_chars)
    if not rows:
        raise ValueError(f"no usable prompts in {source} (max_prompt_chars={max_prompt_chars}, "
                         f"{skipped} too long)")
    rows = interleave_workloads(rows, workload_of_prompt)
    prompts_path = out_dir / "prompts_used.jsonl"
    write_jsonl_atomic(prompts_path, rows)
    wl = [workload_of_prompt(r) for r in rows]
    cfg = BenchConfig(concurrency=tuple(int(c) for c in concurrency), duration_s=int(duration_s),
                      max_tokens=int(max_tokens), stop_timeout_s=stop_timeout_s,
                      warmup_requests=int(warmup_requests), warmup_waves=int(warmup_waves))
    if any(c < 1 for c in cfg.concurrency) or cfg.duration_s < 1 or cfg.max_tokens < 1:
        raise ValueError("concurrency, duration and max_tokens must be >= 1")
    if cfg.warmup_requests < 0 or cfg.warmup_waves < 0:
        raise ValueError(f"warmup_requests and warmup_waves must be >= 0, not {cfg.warmup_requests} "
                         f"and {cfg.warmup_waves}")
    endpoints = ([("baseline", baseline_url)] if baseline_url else []) + [("eagle3", url)]
    wave_levels = tuple(c for c in cfg.concurrency if c > 1) if cfg.warmup_waves else ()
    for label, u in endpoints if cfg.warmup_requests or wave_levels else ():
        print(f"[bench] {label}: warm-up, {cfg.warmup_requests} requests one at a time"
              + (f", then {cfg.warmup_waves} wave(s) of c at once at c = {list(wave_levels)}" if wave_levels else "")
              + f", {cfg.max_tokens} tokens each …", file=sys.stderr, flush=True)
        warm_up(u, api_key, rows, cfg.warmup_requests, cfg.max_tokens, wave_levels, cfg.warmup_waves)
    servers = {label: server_info(u, api_key) for label, u in endpoints}
    runs, cells_total = [], len(cfg.concurrency) * len(endpoints)
    for level, c in enumerate(cfg.concurrency):
        for label, u in endpoints if level % 2 == 0 else endpoints[::-1]:
            report_progress("bench", len(runs), cells_total, "cells", f"{label} c={c} for {cfg.duration_s}s …")
            before = server_info(u, api_key)
            t0 = time.time()
            recs = run_locust(u, label, c, prompts_path, cfg, out_dir, api_key)
            after = server_info(u, api_key)
            for r in recs:
                r["workload"] = wl[r["prompt_idx"]] if 0 <= r.get("prompt_idx", -1) < len(wl) else ALL
            tau, src = tau_between(before, after)
            cells = summarize(recs, wl)
            if cells[ALL]["tau"] is None and tau is not None:
                cells[ALL].update(tau=tau, tau_source=src)
            cells[ALL]["tau_server_info"] = tau
            for name in ("draft_size", "batch_size"):  # server-wide, so not per workload
                mean, hist = hist_between(before, after, f"{name}_hist")
                cells[ALL].update({f"mean_{name}": mean, f"{name}_hist": hist})
            if not recs:
                cells[ALL]["note"] = "no request finished in the window"
            runs.append({"endpoint": label, "url": u, "concurrency": c, "started": t0,
                         "cells": cells})
            a = cells[ALL]
            report_progress("bench", len(runs), cells_total, "cells",
                            f"{label} c={c}: requests={a['requests']} failures={a['failures']} "
                            f"median_tpot_ms={_ms(a['median_tpot_s'])} tok/s={_fmt(a['output_tok_per_s'])} "
                            f"tau={_fmt(a['tau'])}")
    results = {"config": {"concurrency": list(cfg.concurrency), "duration_s": cfg.duration_s,
                          "max_tokens": cfg.max_tokens, "warmup_requests": cfg.warmup_requests,
                          "warmup_waves": cfg.warmup_waves,
                          "prompts": Path(source).name,  # the path may be a scratch dir, gone once published
                          "n_prompts": len(rows), "prompts_skipped_too_long": skipped,
                          "max_prompt_chars": max_prompt_chars, "workloads": sorted(set(wl)),
                          "endpoints": {k: v for k, v in endpoints}},
               "servers": servers, "environment": environment(), "runs": runs}
    results["headline"] = headline(results)
    if write_report:
        from eagle3_platform.bench.report import write_report as _write
        results["files"] = _write(results, out_dir)
    return results


def environment() -> dict:
    """Where the sweep ran, for the report's header: date (UTC), CPU model, GPU name (nvidia-smi,
    when there is one) and the git commit of this checkout; None for what cannot be found (an
    installed package has no git checkout: never an error)."""
    import datetime
    import platform
    import shutil

    def _out(cmd: list[str], cwd=None) -> str | None:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None

    cpu = platform.processor() or None
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = _out(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) if shutil.which("nvidia-smi") else None
    commit = _out(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).parent) if shutil.which("git") else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu, "cpus": os.cpu_count(), "gpu": gpu, "commit": commit}


def select_prompts(rows: list[dict], max_chars: int | None) -> tuple[list[dict], int]:
    """Validates every record (fails before any load is generated, naming the record) and drops
    those whose sent turns exceed max_chars; returns (kept, n_skipped)."""
    kept = []
    for r in rows:
        n = sum(len(m["content"]) for m in prompt_messages(r))
        if max_chars is None or n <= max_chars:
            kept.append(r)
    return kept, len(rows) - len(kept)


def interleave_workloads(rows: list[dict], workload_of: Callable[[dict], str]) -> list[dict]:
    """Rows reordered so every prefix holds the workloads in their overall proportions.

    Locust sends the prompts in file order and a cell ends after its duration, so a cell only sees
    a prefix: with the file grouped by workload, c = 1 saw chat and multi_turn alone while c = 8
    also got the long-context prompts, and a faster endpoint reached further into the file than
    its baseline. Row i of a workload with n rows sits at (i + 0.5) / n; ties keep workload order."""
    wl = [workload_of(r) for r in rows]
    size, seen = Counter(wl), Counter()  # Counter keeps first-seen order: the tie-break
    order = {w: j for j, w in enumerate(size)}
    keys = []
    for w in wl:
        keys.append(((seen[w] + 0.5) / size[w], order[w]))
        seen[w] += 1
    return [r for _, r in sorted(zip(keys, rows), key=lambda kr: kr[0])]


def headline(results: dict) -> dict:
    """Median TPOT at the lowest concurrency, baseline vs EAGLE-3, speedup, τ, throughput ratios."""
    cells = {(r["endpoint"], r["concurrency"]): r["cells"][ALL] for r in results["runs"]}
    cs = sorted({c for _, c in cells})
    if not cs:
        return {}
    c0 = cs[0]
    e = cells.get(("eagle3", c0), {})
    b = cells.get(("baseline", c0))
    out = {"concurrency": c0, "eagle3_median_tpot_ms": _ms(e.get("median_tpot_s")),
           "eagle3_tau": e.get("tau")}
    if b:
        out["baseline_median_tpot_ms"] = _ms(b.get("median_tpot_s"))
        if b.get("median_tpot_s") and e.get("median_tpot_s"):
            out["tpot_speedup"] = b["median_tpot_s"] / e["median_tpot_s"]
        out["throughput_ratio"] = {
            str(c): cells[("eagle3", c)]["output_tok_per_s"] / cells[("baseline", c)]["output_tok_per_s"]
            for c in cs if ("baseline", c) in cells and ("eagle3", c) in cells
            and cells[("baseline", c)].get("output_tok_per_s")
            and cells[("eagle3", c)].get("output_tok_per_s")}
    # how each endpoint scales with concurrency against its own lowest level ("throughput at c = 8 vs
    # c = 1", "median TTFT at c = 8 vs c = 1")
    for label in ("baseline", "eagle3"):
        for name, key in (("throughput_scaling", "output_tok_per_s"), ("ttft_scaling", "median_ttft_s")):
            ratios = _vs_lowest(cells, label, key, cs)
            if ratios:
                out[f"{label}_{name}"] = ratios
    out["failures"] = sum(v.get("failures", 0) for v in cells.values())
    return out


def _vs_lowest(cells: dict, label: str, key: str, cs: list[int]) -> dict[str, float]:
    """{c: cell(c)[key] / cell(c0)[key]} for label's levels above the lowest (c0); {} if unmeasured."""
    base = cells.get((label, cs[0]), {}).get(key)
    if not base:
        return {}
    return {str(c): cells[(label, c)][key] / base for c in cs[1:]
            if (label, c) in cells and cells[(label, c)].get(key)}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000.0, 2)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
