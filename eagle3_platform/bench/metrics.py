"""Per-request benchmark metrics and their aggregation (pure Python: shared by Locust and the report).

Definitions (docs/ARCHITECTURE.md §6):
  TTFT  = time from sending the request to the first content chunk
  TPOT  = (latency − TTFT) / (output_tokens − 1)      (undefined for a 1-token output)
  output throughput = Σ output tokens of completed requests / wall time of the run
  τ     = Σ accepted tokens / Σ verify steps           (per request from the embedded server's
          usage extension; otherwise from /server_info before/after a run)
  mean draft size / batch size = Σ k·steps / Σ steps over the delta of the embedded server's
          draft_size_hist / batch_size_hist on /server_info before/after a run
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

from eagle3_platform.draft.metrics import acceptance_length
from eagle3_platform.serve.sglang import spec_accept_length


def tpot(latency_s: float, ttft_s: float | None, output_tokens: int) -> float | None:
    if ttft_s is None or output_tokens < 2:
        return None
    return (latency_s - ttft_s) / (output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def aggregate(records: Sequence[dict], wall_s: float | None = None) -> dict:
    """Summary of one (endpoint, concurrency[, workload]) cell from per-request records."""
    ok = [r for r in records if r.get("ok")]
    failures = len(records) - len(ok)
    if wall_s is None:
        wall_s = wall_time(records)
    tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    steps = sum(int(r.get("verify_steps") or 0) for r in ok)
    accepted = sum(int(r.get("accepted_tokens") or 0) for r in ok)
    ttfts = [r.get("ttft_s") for r in ok]
    tpots = [r.get("tpot_s") for r in ok]
    return {
        "requests": len(ok),
        "failures": failures,
        "median_ttft_s": median(ttfts),
        "p90_ttft_s": percentile(ttfts, 90),
        "median_tpot_s": median(tpots),
        "p10_tpot_s": percentile(tpots, 10),
        "p90_tpot_s": percentile(tpots, 90),
        "median_latency_s": median(r.get("latency_s") for r in ok),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_per_s": tokens / wall_s if wall_s else None,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "tau": acceptance_length(accepted, steps),
        "tau_source": "requests" if steps else None,
    }


def wall_time(records: Sequence[dict]) -> float | None:
    """From the first request's start to the last completion (covers the stop-timeout drain)."""
    spans = [(r["start"], r["start"] + r["latency_s"]) for r in records
             if r.get("start") is not None and r.get("latency_s") is not None]
    if not spans:
        return None
    return max(e for _, e in spans) - min(s for s, _ in spans)


def tau_between(before: dict | None, after: dict | None) -> tuple[float | None, str | None]:
    """τ over a window from two /server_info snapshots.

    Exact when the server exposes counters (embedded server: spec_accepted_tokens/spec_verify_steps).
    SGLang exposes only a cumulative average: exact if nothing ran before the window, otherwise the
    post-window cumulative average is returned and labelled as such.
    """
    if not after:
        return None, None
    keys = ("spec_accepted_tokens", "spec_verify_steps")
    if before and all(k in before and k in after for k in keys):
        steps = after["spec_verify_steps"] - before["spec_verify_steps"]
        acc = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        return (acceptance_length(acc, steps), "server_info_delta") if steps > 0 else (None, None)
    tau = spec_accept_length(after)
    if tau is None:
        return None, None
    fresh = before is None or spec_accept_length(before) is None
    return tau, "server_info" if fresh else "server_info_cumulative"


def hist_between(before: dict | None, after: dict | None,
                 key: str) -> tuple[float | None, dict[str, int] | None]:
    """Mean and delta of a lifetime {size: decode steps} histogram on /server_info over a window
    (embedded server: draft_size_hist, batch_size_hist); (None, None) when either snapshot lacks
    it (SGLang, older servers) or no step was counted in the window."""
    if not before or not after or key not in before or key not in after:
        return None, None
    delta = {k: int(n) - int(before[key].get(k, 0)) for k, n in after[key].items()}
    delta = {k: n for k, n in sorted(delta.items(), key=lambda kv: int(kv[0])) if n > 0}
    steps = sum(delta.values())
    if not steps:
        return None, None
    return sum(int(k) * n for k, n in delta.items()) / steps, delta
