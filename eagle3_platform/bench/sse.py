"""OpenAI SSE stream parsing for the benchmark (kept out of the locustfile so it is testable
without importing Locust)."""
from __future__ import annotations

import json
import time


def read_stream(lines, t0: float) -> dict:
    """Parse OpenAI SSE lines -> {ttft_s (first non-empty content), chunks (content chunks), usage
    (from the include_usage chunk, if any), error (None when the stream ended with [DONE])}."""
    ttft, chunks, usage, error, done = None, 0, None, None, False
    for raw in lines:
        if not raw:
            continue
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            error = err.get("message", "stream error") if isinstance(err, dict) else str(err)
            continue
        if obj.get("usage"):
            usage = obj["usage"]
        for ch in obj.get("choices") or []:
            text = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
            if text:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    if not done and error is None:
        error = "stream ended without [DONE]"
    return {"ttft_s": ttft, "chunks": chunks, "usage": usage, "error": error}
