"""Locust user for the benchmark: streaming /v1/chat/completions from a prompts JSONL.

Run only as its own process (Locust/gevent monkey-patches sockets on import), e.g.
    locust -f eagle3_platform/bench/locustfile.py --headless -u 4 -r 4 --run-time 30s \
        --host http://127.0.0.1:8000 --only-summary --prompts eval.jsonl --bench-out req.jsonl
Options may also come from the environment: EAGLE3_BENCH_PROMPTS, EAGLE3_BENCH_OUT,
EAGLE3_BENCH_MAX_TOKENS, EAGLE3_BENCH_LABEL, EAGLE3_BENCH_CONCURRENCY, EAGLE3_API_KEY.
Each finished request appends one JSON line (ttft_s, latency_s, output_tokens, tpot_s, τ counters,
ok/error) to --bench-out. No prompt or output text is written.
"""
from __future__ import annotations

import itertools
import json
import time

from locust import HttpUser, constant, events, task

from eagle3_platform.bench.metrics import tpot
from eagle3_platform.bench.prompts import prompt_messages
from eagle3_platform.bench.sse import read_stream

DEFAULT_MAX_TOKENS = 64
REQUEST_TIMEOUT_S = 600


@events.init_command_line_parser.add_listener
def _args(parser):
    parser.add_argument("--prompts", env_var="EAGLE3_BENCH_PROMPTS", default="",
                        help="prompts JSONL (PromptRecord rows or {'prompt': str})")
    parser.add_argument("--bench-out", env_var="EAGLE3_BENCH_OUT", default="",
                        help="per-request JSONL output")
    parser.add_argument("--max-tokens", env_var="EAGLE3_BENCH_MAX_TOKENS", type=int,
                        default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--bench-label", env_var="EAGLE3_BENCH_LABEL", default="endpoint")
    parser.add_argument("--bench-concurrency", env_var="EAGLE3_BENCH_CONCURRENCY", type=int,
                        default=0)
    parser.add_argument("--api-key", env_var="EAGLE3_API_KEY", default="")
    parser.add_argument("--model-name", env_var="EAGLE3_BENCH_MODEL", default="default")


_STATE: dict = {}


@events.test_start.add_listener
def _load(environment, **_):
    opts = environment.parsed_options
    if not opts.prompts:
        raise SystemExit("locustfile: --prompts / EAGLE3_BENCH_PROMPTS is required")
    with open(opts.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"locustfile: no prompts in {opts.prompts}")
    _STATE["prompts"] = [(i, prompt_messages(r)) for i, r in enumerate(rows)]
    _STATE["next"] = itertools.count()
    _STATE["out"] = open(opts.bench_out, "a", encoding="utf-8") if opts.bench_out else None


@events.test_stop.add_listener
def _close(environment, **_):
    if _STATE.get("out"):
        _STATE["out"].close()
        _STATE["out"] = None


class ChatUser(HttpUser):
    """Closed loop: each user sends the next prompt as soon as its previous request finished."""

    wait_time = constant(0)

    @task
    def chat(self):
        opts = self.environment.parsed_options
        idx, messages = _STATE["prompts"][next(_STATE["next"]) % len(_STATE["prompts"])]
        body = {"model": opts.model_name, "messages": messages, "max_tokens": opts.max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        start, t0 = time.time(), time.perf_counter()
        rec = {"endpoint": opts.bench_label, "concurrency": opts.bench_concurrency,
               "prompt_idx": idx, "start": start}
        with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True,
                              catch_response=True, name="chat_stream",
                              timeout=REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                rec.update(ok=False, error=f"HTTP {resp.status_code}",
                           latency_s=time.perf_counter() - t0)
                resp.failure(rec["error"])
            else:
                rec.update(self._measure(resp, t0))
                if not rec["ok"]:
                    resp.failure(rec["error"])
        self._write(rec)

    @staticmethod
    def _measure(resp, t0: float) -> dict:
        try:
            got = read_stream(resp.iter_lines(), t0)
        except Exception as e:  # broken stream / bad JSON: a failed request, not a crashed user
            return {"ok": False, "error": f"{type(e).__name__}", "latency_s": time.perf_counter() - t0}
        latency = time.perf_counter() - t0
        use = got["usage"] or {}
        n_out = int(use.get("completion_tokens", got["chunks"]))
        return {"ok": got["error"] is None, "error": got["error"], "latency_s": latency,
                "ttft_s": got["ttft_s"], "output_tokens": n_out,
                "output_tokens_source": "usage" if got["usage"] else "chunks",
                "tpot_s": tpot(latency, got["ttft_s"], n_out),
                "verify_steps": use.get("spec_verify_steps"),
                "accepted_tokens": use.get("spec_accepted_tokens")}

    @staticmethod
    def _write(rec: dict) -> None:
        out = _STATE.get("out")
        if out is not None:
            out.write(json.dumps(rec) + "\n")
            out.flush()
