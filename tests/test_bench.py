"""Benchmark: metrics, SSE parsing, report files, and real headless Locust runs (integration)."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from eagle3_platform.bench.metrics import (aggregate, hist_between, percentile, tau_between, tpot,
                                           wall_time)
from eagle3_platform.bench.prompts import prompt_messages
from eagle3_platform.bench.sse import read_stream

PROMPTS = [
    {"id": "a", "workload": "chat", "source": "t", "license": "t",
     "messages": [{"role": "user", "content": "Tell me about foxes."}]},
    {"id": "b", "workload": "code", "source": "t", "license": "t",
     "messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Write add(a, b)."},
                  {"role": "user", "content": "Now sub."}]},
    {"id": "c", "workload": "math", "source": "t", "license": "t",
     "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
]


@pytest.fixture()
def prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return p


def test_tpot_definition():
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(1.0, 0.1, 1) is None and tpot(1.0, None, 5) is None


def test_percentile_and_aggregate():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 90) == 5
    assert percentile([], 50) is None
    recs = [{"ok": True, "start": 0.0, "latency_s": 1.0, "ttft_s": 0.1, "output_tokens": 10,
             "tpot_s": 0.1, "verify_steps": 3, "accepted_tokens": 9},
            {"ok": True, "start": 1.0, "latency_s": 1.0, "ttft_s": 0.3, "output_tokens": 8,
             "tpot_s": 0.1, "verify_steps": 4, "accepted_tokens": 7},
            {"ok": False, "start": 2.0, "latency_s": 0.5, "error": "HTTP 503"}]
    a = aggregate(recs)
    assert a["requests"] == 2 and a["failures"] == 1
    assert a["median_ttft_s"] == pytest.approx(0.2)
    assert a["output_tokens"] == 18 and a["wall_s"] == pytest.approx(2.5)
    assert a["output_tok_per_s"] == pytest.approx(18 / 2.5)
    assert a["tau"] == pytest.approx(16 / 7)
    assert wall_time([]) is None


def test_p90_ttft_from_records():
    # Linear interpolation like the other percentiles: rank 0.9 * 9 = 8.1 -> 0.9 + 0.1 * 0.1
    # (nearest rank would give 0.9 or 1.0); failed requests and missing TTFTs are left out.
    recs = [{"ok": True, "ttft_s": t / 10} for t in (7, 3, 10, 1, 5, 9, 2, 8, 4, 6)]
    recs += [{"ok": False, "ttft_s": 50.0}, {"ok": True, "ttft_s": None}]
    a = aggregate(recs, wall_s=1.0)
    assert a["p90_ttft_s"] == pytest.approx(0.91) and a["median_ttft_s"] == pytest.approx(0.55)
    assert aggregate([], wall_s=1.0)["p90_ttft_s"] is None


def test_hist_between_delta_and_mean():
    before = {"draft_size_hist": {"0": 5, "2": 10}, "batch_size_hist": {"1": 7}}
    after = {"draft_size_hist": {"0": 6, "2": 10, "3": 3, "10": 1}, "batch_size_hist": {"1": 7}}
    mean, hist = hist_between(before, after, "draft_size_hist")
    assert hist == {"0": 1, "3": 3, "10": 1} and list(hist) == ["0", "3", "10"]  # numeric order
    assert mean == pytest.approx((0 * 1 + 3 * 3 + 10 * 1) / 5)
    assert hist_between(before, after, "batch_size_hist") == (None, None)  # counters did not move
    assert hist_between({}, after, "draft_size_hist") == (None, None)      # older server / SGLang
    assert hist_between(None, after, "draft_size_hist") == (None, None)
    assert hist_between(before, {"avg_spec_accept_length": 2.0}, "draft_size_hist") == (None, None)


def test_tau_between_counters_and_sglang_average():
    b = {"spec_accepted_tokens": 10, "spec_verify_steps": 10, "avg_spec_accept_length": 1.0}
    a = {"spec_accepted_tokens": 40, "spec_verify_steps": 20, "avg_spec_accept_length": 2.0}
    assert tau_between(b, a) == (pytest.approx(3.0), "server_info_delta")
    sg_before = {"internal_states": [{"avg_spec_accept_length": None}]}
    sg_after = {"internal_states": [{"avg_spec_accept_length": 2.5}]}
    assert tau_between(sg_before, sg_after) == (2.5, "server_info")
    assert tau_between(sg_after, sg_after)[1] == "server_info_cumulative"
    assert tau_between(None, None) == (None, None)


def test_prompt_messages():
    assert prompt_messages(PROMPTS[1]) == PROMPTS[1]["messages"][:2]
    assert prompt_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError):
        prompt_messages({"id": "x", "messages": [{"role": "system", "content": "s"}]})


def test_select_prompts_skips_long_and_rejects_bad():
    from eagle3_platform.bench.run import select_prompts

    kept, skipped = select_prompts(PROMPTS, 20)
    assert [r["id"] for r in kept] == ["a", "c"] and skipped == 1   # b: system + user > 20 chars
    assert select_prompts(PROMPTS, None) == (PROMPTS, 0)
    with pytest.raises(ValueError, match="neither"):
        select_prompts([{"id": "z"}], None)


def test_interleave_workloads_balances_every_prefix():
    from eagle3_platform.bench.run import default_workload, interleave_workloads

    rows = ([{"id": f"c{i}", "workload": "chat"} for i in range(2)]
            + [{"id": f"l{i}", "workload": "long"} for i in range(4)]
            + [{"id": f"m{i}", "workload": "math"} for i in range(4)])
    out = interleave_workloads(rows, default_workload)
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)  # nothing lost or doubled
    for w in ("chat", "long", "math"):  # order within a workload kept
        ids = [r["id"] for r in out if r["workload"] == w]
        assert ids == sorted(ids)
    for n in range(1, len(out) + 1):  # every prefix within one row of its workload's share
        for w, size in (("chat", 2), ("long", 4), ("math", 4)):
            got = sum(r["workload"] == w for r in out[:n])
            assert abs(got - n * size / len(rows)) <= 1, (n, w, [r["id"] for r in out])
    assert out[:2] == [rows[2], rows[6]]  # the grouped file began with both chat rows


def test_read_stream():
    lines = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', b"",
             b'data: {"choices":[{"delta":{"content":"Hel"}}]}',
             b'data: {"choices":[{"delta":{"content":"lo"}}]}',
             b'data: {"choices":[],"usage":{"completion_tokens":3,"spec_verify_steps":1}}',
             b"data: [DONE]"]
    got = read_stream(iter(lines), 0.0)
    assert got["chunks"] == 2 and got["error"] is None and got["ttft_s"] is not None
    assert got["usage"]["completion_tokens"] == 3
    assert read_stream(iter(lines[:3]), 0.0)["error"] == "stream ended without [DONE]"
    err = read_stream(iter([b'data: {"error":{"message":"boom"}}', b"data: [DONE]"]), 0.0)
    assert err["error"] == "boom"


def test_report_files_from_results(tmp_path):
    from eagle3_platform.bench.report import write_report
    from eagle3_platform.bench.run import headline

    def cell(tpot_s, tps, tau):
        return {"requests": 5, "failures": 0, "median_ttft_s": 0.05, "p90_ttft_s": 0.06,
                "median_tpot_s": tpot_s, "p10_tpot_s": tpot_s / 2, "p90_tpot_s": tpot_s * 2,
                "median_latency_s": 1.0,
                "output_tokens": 100, "wall_s": 5.0, "output_tok_per_s": tps, "tau": tau}
    runs = [{"endpoint": ep, "concurrency": c, "cells": {"all": cell(t, s, tau), "chat": cell(t, s, tau)}}
            for ep, t, s, tau in (("baseline", 0.04, 25.0, 1.0), ("eagle3", 0.02, 50.0, 2.4))
            for c in (1, 2)]
    results = {"config": {"concurrency": [1, 2], "duration_s": 5, "max_tokens": 16,
                          "prompts": "p.jsonl", "n_prompts": 3, "workloads": ["chat"],
                          "endpoints": {"baseline": "u0", "eagle3": "u1"}}, "runs": runs}
    runs[2]["cells"]["all"].update(mean_draft_size=1.5, mean_batch_size=3.25)   # eagle3 c=1
    results["headline"] = h = headline(results)
    assert h["tpot_speedup"] == pytest.approx(2.0) and h["throughput_ratio"]["2"] == pytest.approx(2.0)
    assert h["baseline_throughput_scaling"] == {"2": pytest.approx(1.0)}  # same cells at c = 1 and 2
    assert h["eagle3_ttft_scaling"] == {"2": pytest.approx(1.0)}
    files = write_report(results, tmp_path)
    for p in files["plots"]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert "| eagle3 | 1 | all | 5 | 0 | 50.0 | 60.0 | 20.0 | 10.0 | 40.0 | 50.00 | 2.40 | 1.50 | 3.25 |" in md
    assert "| baseline | 1 | all | 5 | 0 | 50.0 | 60.0 | 40.0 | 20.0 | 80.0 | 25.00 | 1.00 | - | - |" in md
    assert "| eagle3 | 1 | chat | 5 | 0 | 50.0 | 60.0 | 20.0 | 10.0 | 40.0 | 50.00 | 2.40 | - | - |" in md
    assert "| p10 TPOT ms | p90 TPOT ms |" in md and "| requests |" in md
    assert "| draft size | batch size |" in md and "tpot_speedup" in md
    assert "| 1 | 2.00× | 2.00× |" in md and "| 2 | 2.00× | 2.00× |" in md  # speedup per concurrency
    assert "| all | 2.40 | 2.40 |" in md and "τ at c = 1 | τ at c = 2" in md
    assert "**target**: unknown" in md and "**hardware**: unknown" in md  # no servers/environment given
    assert "speedup_vs_concurrency.png" in [Path(p).name for p in files["plots"]]
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5  # self-contained
    assert "Speedup per concurrency" in html and "<td>2.00×</td>" in html
    assert json.loads((tmp_path / "results.json").read_text())["headline"]["tpot_speedup"] == 2.0


def test_headline_scaling_against_the_lowest_concurrency():
    from eagle3_platform.bench.run import headline

    def run(ep, c, tps, ttft):
        return {"endpoint": ep, "concurrency": c,
                "cells": {"all": {"output_tok_per_s": tps, "median_ttft_s": ttft, "failures": 0}}}
    runs = [run("baseline", 1, 20.0, 0.1), run("baseline", 8, 70.0, 0.35),
            run("eagle3", 1, 25.0, 0.2), run("eagle3", 4, 50.0, 0.3)]
    h = headline({"runs": runs})
    assert h["baseline_throughput_scaling"] == {"8": pytest.approx(3.5)}
    assert h["baseline_ttft_scaling"] == {"8": pytest.approx(3.5)}
    assert h["eagle3_throughput_scaling"] == {"4": pytest.approx(2.0)}  # only the levels it ran
    assert h["eagle3_ttft_scaling"] == {"4": pytest.approx(1.5)}
    alone = headline({"runs": runs[2:]})  # no baseline endpoint: no baseline keys
    assert "baseline_throughput_scaling" not in alone and alone["eagle3_throughput_scaling"] == {
        "4": pytest.approx(2.0)}


def test_sweep_cells_carry_server_histograms(tmp_path, prompts_file, monkeypatch):
    from eagle3_platform.bench import run

    calls = []

    def info(url, api_key):  # lifetime counters that grow by one window per snapshot
        calls.append(url)
        n = len(calls)
        return {"draft_size_hist": {"1": n, "3": 3 * n}, "batch_size_hist": {"4": 2 * n}}

    rec = {"ok": True, "start": 0.0, "latency_s": 1.0, "ttft_s": 0.1, "output_tokens": 5,
           "tpot_s": 0.2, "prompt_idx": 0}
    monkeypatch.setattr(run, "server_info", info)
    monkeypatch.setattr(run, "run_locust", lambda *a, **k: [dict(rec)])
    res = run.run_benchmark("http://x", prompts_file, concurrency=[1], duration_s=1,
                            out_dir=tmp_path, warmup_requests=0, write_report=False)
    cells = res["runs"][0]["cells"]
    assert cells["all"]["draft_size_hist"] == {"1": 1, "3": 3}
    assert cells["all"]["mean_draft_size"] == pytest.approx(2.5)
    assert cells["all"]["batch_size_hist"] == {"4": 2} and cells["all"]["mean_batch_size"] == 4.0
    assert "mean_draft_size" not in cells["chat"]   # server-wide counters: the 'all' cell only


def test_the_endpoint_that_goes_first_alternates_by_level(tmp_path, prompts_file, monkeypatch):
    """A box that slows through the sweep would favour whoever goes first at every level; the report's
    table still reads baseline, then EAGLE-3, per level."""
    from eagle3_platform.bench import run
    from eagle3_platform.bench.report import rows

    order = []
    rec = {"ok": True, "start": 0.0, "latency_s": 1.0, "ttft_s": 0.1, "output_tokens": 5,
           "tpot_s": 0.2, "prompt_idx": 0}

    def locust(url, label, c, *args, **kwargs):
        order.append((label, c))
        return [dict(rec)]

    monkeypatch.setattr(run, "server_info", lambda url, key: None)
    monkeypatch.setattr(run, "run_locust", locust)
    res = run.run_benchmark("http://e", prompts_file, concurrency=[1, 2, 4], duration_s=1, out_dir=tmp_path,
                            baseline_url="http://b", warmup_requests=0, warmup_waves=0, write_report=False)
    assert order == [("baseline", 1), ("eagle3", 1), ("eagle3", 2), ("baseline", 2), ("baseline", 4),
                     ("eagle3", 4)]
    assert [(r["endpoint"], r["concurrency"]) for r in rows(res)] == [
        ("baseline", 1), ("eagle3", 1), ("baseline", 2), ("eagle3", 2), ("baseline", 4), ("eagle3", 4)]


def test_each_endpoint_serves_its_warm_up_requests_before_the_first_cell(tmp_path, prompts_file, monkeypatch):
    """Warm-up: n requests per endpoint, one at a time, at the sweep's max_tokens, the prompts cycled,
    all before any measured cell; recorded in the results' config."""
    from eagle3_platform.bench import run

    events = []

    class Response:
        status_code, text = 200, ""

    def post(url, json, headers, timeout):
        events.append(("warm", url.split("/v1")[0], json["max_tokens"], json["messages"][-1]["content"]))
        return Response()

    monkeypatch.setattr(run.httpx, "post", post)
    monkeypatch.setattr(run, "server_info", lambda url, key: None)
    monkeypatch.setattr(run, "run_locust", lambda url, label, c, *a, **k: events.append(("cell", label, c)) or [])
    res = run.run_benchmark("http://e", prompts_file, concurrency=[1], duration_s=1, out_dir=tmp_path,
                            baseline_url="http://b", max_tokens=7, warmup_requests=4, write_report=False)
    warm = [e for e in events if e[0] == "warm"]
    assert events[:8] == warm and [e[0] for e in events[8:]] == ["cell", "cell"]
    assert [e[1] for e in warm] == ["http://b"] * 4 + ["http://e"] * 4 and {e[2] for e in warm} == {7}
    sent = [e[3] for e in warm[:4]]
    assert len(set(sent[:3])) == 3 and sent[3] == sent[0]  # three prompts, cycled
    assert res["config"]["warmup_requests"] == 4
    with pytest.raises(ValueError, match="warmup_requests"):
        run.run_benchmark("http://e", prompts_file, concurrency=[1], duration_s=1, out_dir=tmp_path,
                          warmup_requests=-1, write_report=False)


def test_warm_up_waves_send_c_requests_at_once_at_every_level_before_the_first_cell(
        tmp_path, prompts_file, monkeypatch):
    """After the one-at-a-time requests, each endpoint serves `warmup_waves` waves of c concurrent
    requests at every level c > 1 (a policy learns its costs per batch size), all before any cell."""
    import threading

    from eagle3_platform.bench import run
    from eagle3_platform.bench.report import markdown

    lock, events, in_flight, peaks = threading.Lock(), [], [0], []

    class Response:
        status_code, text = 200, ""

    def post(url, json, headers, timeout):
        with lock:
            in_flight[0] += 1
            events.append(("warm", url.split("/v1")[0]))
        time.sleep(0.05)  # long enough for the rest of a concurrent wave to arrive
        with lock:
            peaks.append(in_flight[0])
            in_flight[0] -= 1
        return Response()

    monkeypatch.setattr(run.httpx, "post", post)
    monkeypatch.setattr(run, "server_info", lambda url, key: None)
    monkeypatch.setattr(run, "run_locust", lambda url, label, c, *a, **k: events.append(("cell", label, c)) or [])
    res = run.run_benchmark("http://e", prompts_file, concurrency=[1, 2, 4], duration_s=1, out_dir=tmp_path,
                            baseline_url="http://b", warmup_requests=1, warmup_waves=2, write_report=False)
    warm = [e for e in events if e[0] == "warm"]
    assert events[:len(warm)] == warm and len(events) - len(warm) == 6  # every warm-up before the cells
    per_endpoint = 1 + 2 * 2 + 2 * 4
    assert [e[1] for e in warm] == ["http://b"] * per_endpoint + ["http://e"] * per_endpoint
    assert max(peaks) == 4 and peaks[0] == 1  # the waves were in flight together; the first alone
    assert res["config"]["warmup_waves"] == 2
    text = markdown({**res, "headline": {}}, [])
    assert "1 warm-up requests per endpoint, then 2 waves of c requests at once at c = [2, 4]" in text
    with pytest.raises(ValueError, match="warmup_waves"):
        run.run_benchmark("http://e", prompts_file, concurrency=[1], duration_s=1, out_dir=tmp_path,
                          warmup_waves=-1, write_report=False)


def _check_results(res, out, endpoints):
    assert {r["endpoint"] for r in res["runs"]} == set(endpoints)
    assert sorted({r["concurrency"] for r in res["runs"]}) == [1, 2]
    for run in res["runs"]:
        a = run["cells"]["all"]
        assert a["failures"] == 0 and a["requests"] >= 1, run
        assert a["median_tpot_s"] > 0 and a["median_ttft_s"] > 0 and a["output_tok_per_s"] > 0
        assert a["tau"] is not None and a["tau"] >= 1.0
    for name in ("report.md", "report.html", "results.json", "tpot_vs_concurrency.png",
                 "throughput_vs_concurrency.png", "tau_per_workload.png"):
        assert (out / name).stat().st_size > 0
    # Per-request rows came from the Locust worker process and carry no text.
    rows = [json.loads(x) for x in (out / "requests" / f"{endpoints[-1]}_c1.jsonl").read_text().splitlines()]
    assert rows and all("content" not in r and "prompt" not in r for r in rows)


@pytest.mark.integration
def test_locust_sweep_against_fake_servers(tmp_path, prompts_file):
    from eagle3_platform.bench.run import run_benchmark
    from eagle3_platform.serve.launch import spawn_server

    cmd = [sys.executable, "-m", "eagle3_platform.testing.serve", "--delay-s", "0.01"]
    eagle = spawn_server(cmd + ["--chunk", "3"], api_key="k", timeout=60)
    base = spawn_server(cmd + ["--chunk", "1"], api_key="k", timeout=60)
    try:
        res = run_benchmark(eagle.url, prompts_file, concurrency=[1, 2], duration_s=2,
                            out_dir=tmp_path / "out", baseline_url=base.url, api_key="k",
                            max_tokens=12)
    finally:
        eagle.stop(), base.stop()
    _check_results(res, tmp_path / "out", ["baseline", "eagle3"])
    cells = {(r["endpoint"], r["concurrency"]): r["cells"] for r in res["runs"]}
    # The fake engine's τ is exact: 1 prefill token, then 3 tokens (eagle) / 1 (baseline) per step.
    assert cells[("eagle3", 1)]["all"]["tau"] == pytest.approx(11 / 4)
    assert cells[("baseline", 2)]["all"]["tau"] == pytest.approx(1.0)
    assert {"chat", "code", "math"} <= set(cells[("eagle3", 1)]) | set(cells[("eagle3", 2)])
    assert res["headline"]["failures"] == 0
    assert cells[("eagle3", 1)]["all"]["mean_draft_size"] is None  # the fake server has no histograms


@pytest.mark.integration
def test_bench_cli_against_tiny_target_servers(tmp_path, prompts_file, tiny_target_dir):
    """`eagle3 bench` (real Locust) against two `eagle3 serve` processes on the tiny target (real
    engine): the baseline and one with a (random, untrained) EAGLE-3 export."""
    import subprocess

    from eagle3_platform.serve.launch import start_embedded_server
    from eagle3_platform.testing.serve import random_export

    export = random_export(tiny_target_dir, tmp_path / "export")
    base = start_embedded_server(tiny_target_dir, log_path=tmp_path / "base.log", timeout=120)
    try:
        eagle = start_embedded_server(tiny_target_dir, export, spec="chain",
                                      log_path=tmp_path / "eagle.log", timeout=120)
        try:
            out = tmp_path / "out"
            proc = subprocess.run(
                [sys.executable, "-m", "eagle3_platform.cli", "bench", "--url", eagle.url,
                 "--baseline-url", base.url, "--concurrency", "1,2", "--prompts",
                 str(prompts_file), "--duration", "6", "--out", str(out), "--max-tokens", "8"],
                capture_output=True, text=True, timeout=400)
        finally:
            assert eagle.stop() == 0
    finally:
        assert base.stop() == 0
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["headline"]["failures"] == 0
    assert summary["headline"]["baseline_median_tpot_ms"] > 0
    res = json.loads((out / "results.json").read_text())
    _check_results(res, out, ["baseline", "eagle3"])
    base_cells = [r["cells"]["all"] for r in res["runs"] if r["endpoint"] == "baseline"]
    assert all(c["tau"] == pytest.approx(1.0) for c in base_cells)  # no draft: one token per step


def test_tau_per_workload_is_kept_per_concurrency_level():
    from eagle3_platform.bench.report import tau_per_level

    runs = [{"endpoint": "eagle3", "concurrency": 2,
             "cells": {"chat": {"accepted_tokens": 10, "verify_steps": 10, "tau": 1.0},
                       "sg": {"verify_steps": 0, "tau": 2.5}}},
            {"endpoint": "eagle3", "concurrency": 1,
             "cells": {"chat": {"accepted_tokens": 30, "verify_steps": 10, "tau": 3.0}}},
            {"endpoint": "baseline", "concurrency": 1,
             "cells": {"chat": {"accepted_tokens": 5, "verify_steps": 5, "tau": 1.0}}}]
    got = tau_per_level({"runs": runs})
    assert got == {"chat": {1: pytest.approx(3.0), 2: pytest.approx(1.0)}, "sg": {2: 2.5}}
    assert list(got["chat"]) == [1, 2]  # ascending levels, not pooled (the pooled τ would be 2.0)


def test_report_header_names_target_head_preset_hardware_date_commit(tmp_path):
    from eagle3_platform.bench.report import header_facts, markdown
    from eagle3_platform.bench.run import environment

    env = environment()
    assert env["date"].endswith("UTC") and env["cpus"] >= 1
    results = {"servers": {"eagle3": {"target_id": "tiny-random", "draft": True, "spec": "tiny",
                                      "head_weights": "packed", "dtype": "float32"}},
               "environment": {**env, "cpu": "Some CPU", "cpus": 4, "gpu": "NVIDIA H200", "commit": "abc123"}}
    facts = header_facts(results)
    assert facts == {"target": "tiny-random", "head": "packed float32", "preset": "tiny",
                     "hardware": "Some CPU (4 cores), NVIDIA H200", "date": env["date"], "commit": "abc123"}
    cfg = {"prompts": str(tmp_path / ".staging" / "bench" / "prompts.jsonl"), "n_prompts": 1, "workloads": ["chat"],
           "max_tokens": 8, "duration_s": 1, "concurrency": [1], "endpoints": {"eagle3": "u"}}
    md = markdown({**results, "config": cfg, "runs": []}, [])
    assert "**commit**: abc123" in md and "`prompts.jsonl`" in md and ".staging" not in md
    served = {**results["servers"]["eagle3"], "head_sha256": "0123456789abcdef" * 4}
    assert header_facts({**results, "servers": {"eagle3": served}})["head"] == "sha256 0123456789ab (packed float32)"
    sglang = {"draft": True, "speculative_draft_model_path": "/data/draft/export"}  # SGLang names its path
    assert header_facts({"servers": {"eagle3": sglang}})["head"] == "export"


def test_environment_without_git_is_not_an_error(monkeypatch):
    import shutil

    from eagle3_platform.bench import run

    monkeypatch.setattr(shutil, "which", lambda name: None)
    env = run.environment()
    assert env["commit"] is None and env["gpu"] is None and env["date"]


def test_inline_images_turns_relative_plot_links_into_png_data_uris(tmp_path):
    import base64

    from eagle3_platform.bench.report import inline_images

    png = b"\x89PNG\r\n\x1a\n" + b"0" * 20
    (tmp_path / "a.png").write_bytes(png)
    md = inline_images("text\n![a.png](a.png)\n![gone.png](gone.png)\n", tmp_path)
    (uri,) = re.findall(r"!\[a\.png\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert base64.b64decode(uri) == png
    assert "![gone.png](gone.png)" in md  # a missing file is left as it was
