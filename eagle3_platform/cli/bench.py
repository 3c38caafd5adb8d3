"""`eagle3 bench`: Locust concurrency sweep against an OpenAI-compatible endpoint (+ baseline)."""
from __future__ import annotations

import os

from eagle3_platform.cli.args import add_preset_arg, require_positive
from eagle3_platform.store.checks import output_dir


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, not {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError("--concurrency values must be >= 1")
    return vals


def add_commands(sub) -> None:
    p = sub.add_parser("bench", help="Locust sweep: TTFT, TPOT, throughput, τ; report + plots")
    p.add_argument("--url", required=True, help="endpoint under test (EAGLE-3)")
    p.add_argument("--baseline-url", default=None, help="endpoint without speculative decoding")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--prompts", required=True, help="prompts JSONL (held-out eval prompts)")
    p.add_argument("--duration", type=int, default=30, help="seconds per (endpoint, concurrency)")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--api-key", default=None, help="bearer key (default: $EAGLE3_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="leave out prompts longer than this (characters of the sent turns), so a small "
                        "context or a slow CPU prefill does not make the sweep a prefill benchmark")
    add_preset_arg(p)  # the warm-up before the sweep and the stop timeout: the preset's BenchConfig
    p.set_defaults(func=bench)


def bench(a) -> dict:
    from eagle3_platform.bench.run import PRESETS, run_benchmark

    output_dir(a.out)
    require_positive(max_tokens=a.max_tokens, duration=a.duration)
    cfg = PRESETS[a.preset]
    if not os.path.exists(a.prompts):
        raise FileNotFoundError(f"prompts file not found: {a.prompts}")
    res = run_benchmark(a.url, a.prompts, concurrency=_ints(a.concurrency), duration_s=a.duration,
                        out_dir=a.out, baseline_url=a.baseline_url,
                        api_key=a.api_key or os.environ.get("EAGLE3_API_KEY"),
                        max_tokens=a.max_tokens, stop_timeout_s=cfg.stop_timeout_s,
                        warmup_requests=cfg.warmup_requests, warmup_waves=cfg.warmup_waves,
                        max_prompt_chars=a.max_prompt_chars)
    return {"out": a.out, "headline": res["headline"], "report": res["files"]["markdown"],
            "html": res["files"]["html"], "results": res["files"]["results"]}
