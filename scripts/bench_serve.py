"""The server's engine worker under concurrency, in process (no HTTP, no Locust), with the methods
rotated round by round so the machine's drift cancels out of the ratios.

Why: on a shared 2-core VM the same requests through the same baseline worker can take 1.7x longer a
few minutes later. A sweep that measures baseline for 30 s and
then EAGLE-3 for 30 s (the Locust report) compares two different machines; here every round serves
the same 2c requests with each method in turn (the order rotating), c clients each keeping one request
in flight through `EngineWorker` (continuous batching, chunked prefill, the draft size policy: what
`eagle3 serve` runs), and a method's figure is Σ tokens / Σ wall over all rounds.

Methods: baseline (no head), eagle3 (the head, draft size chosen per step by spec/policy.py, one
policy across all levels as in a server), and with --fixed K,... eagle3_kK (the head with draft size K
at every step; K = 0 is the head's upkeep alone: features captured and queued, nothing drafted). Per
level and method: output tok/s, the ratio to baseline, the draft sizes chosen, and against baseline's
greedy outputs the share of requests that differ and of tokens before the first difference
(bench_batch.agreement; exact in fp32, bf16 kernels are not batch-invariant).

  python scripts/bench_serve.py --target T --draft EXPORT --concurrency 1,2,4,8 --rounds 4 --out serve.json
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench_batch import agreement  # noqa: E402
from bench_decode import load_prompt_ids  # noqa: E402

from eagle3_platform.model.target import load_target  # noqa: E402
from eagle3_platform.serve.worker import EngineWorker, Job  # noqa: E402
from eagle3_platform.spec.config import get_preset  # noqa: E402
from eagle3_platform.spec.engine import SpecEngine  # noqa: E402
from eagle3_platform.spec.policy import DraftSizePolicy  # noqa: E402

MAX_QUEUE, MAX_BATCH, PREFILL_CHUNK = 64, 16, 256  # the cpu serve preset's


class FixedDraftSize:
    """A policy that always answers k (the worker's policy interface)."""

    def __init__(self, k: int):
        self.k = k

    def choose(self, batch_size: int) -> int:
        return self.k

    def observe(self, *args, **kwargs) -> None:
        pass

    def info(self) -> dict:
        return {"draft_size_current": self.k}


def serve(worker: EngineWorker, requests: list[list[int]], clients: int, max_tokens: int):
    """c clients, each one request in flight until the list is served -> (outputs, seconds)."""
    todo, lock, outs = iter(enumerate(requests)), threading.Lock(), [[] for _ in requests]
    errors = []

    def client():
        while True:
            with lock:
                i, ids = next(todo, (None, None))
            if ids is None:
                return
            done = threading.Event()

            def emit(ev, i=i, done=done):
                if ev[0] == "tokens":
                    outs[i].extend(ev[1])
                else:
                    if ev[0] == "error":
                        errors.append(ev[1])
                    done.set()
            worker.submit(Job(ids, max_tokens, emit=emit))
            done.wait()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return outs, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 head")
    ap.add_argument("--prompts", default=None, help="prompt records (JSONL; default: held-out MT-bench)")
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per level (each method once per round)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec", default="chain_adaptive_lookup", help="spec preset (the cpu servers')")
    ap.add_argument("--fixed", default="", help="fixed draft sizes to compare, e.g. 0,1 (0: upkeep alone)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads outside the forwards (server: 1)")
    ap.add_argument("--target-threads", type=int, default=0, help="the target's forward threads (0 = all)")
    ap.add_argument("--draft-threads", type=int, default=0, help="threads of the head's drafting (0 = all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.max_tokens < 1:
        ap.error("need --rounds >= 1 and --max-tokens >= 1")
    levels = [int(c) for c in a.concurrency.split(",")]
    torch.set_num_threads(a.threads)
    target = load_target(a.target, dtype=a.dtype)
    from eagle3_platform.draft.export import load_export
    draft = load_export(a.draft, target)
    prompts = load_prompt_ids(a, target.tokenizer)
    base = SpecEngine(target, None, get_preset("baseline"), a.target_threads)
    eagle = SpecEngine(target, draft, get_preset(a.spec), a.target_threads, a.draft_threads)
    policy = DraftSizePolicy(eagle.cfg.num_draft_tokens - 1)
    workers = {"baseline": EngineWorker(base, MAX_QUEUE, MAX_BATCH, PREFILL_CHUNK),
               "eagle3": EngineWorker(eagle, MAX_QUEUE, MAX_BATCH, PREFILL_CHUNK, policy)}
    for k in (int(k) for k in a.fixed.split(",") if k):
        workers[f"eagle3_k{k}"] = EngineWorker(eagle, MAX_QUEUE, MAX_BATCH, PREFILL_CHUNK, FixedDraftSize(k))
    for w in workers.values():
        w.start()
    names, rows = list(workers), []
    try:
        serve(workers["baseline"], prompts[:1], 1, 4)  # warm-up
        for c in levels:
            outs, seconds, hist0 = {m: [] for m in names}, dict.fromkeys(names, 0.0), dict(policy.hist)
            for r in range(a.rounds):
                requests = [prompts[(r * 2 * c + i) % len(prompts)] for i in range(2 * c)]
                for m in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
                    round_outs, s = serve(workers[m], requests, c, a.max_tokens)
                    outs[m] += round_outs
                    seconds[m] += s
                print(f"[bench] c={c} round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
            rate = {m: sum(len(o) for o in outs[m]) / seconds[m] for m in names}
            hist = {k: n - hist0.get(k, 0) for k, n in sorted(policy.hist.items()) if n > hist0.get(k, 0)}
            for m in names:
                same = agreement(outs[m], outs["baseline"])
                row = {"concurrency": c, "method": m, "tok_s": round(rate[m], 2),
                       "vs_baseline": round(rate[m] / rate["baseline"], 3), "requests": len(outs[m]),
                       "outputs_differing_from_baseline": same["requests_differing"],
                       "token_agreement_with_baseline": same["token_agreement"],
                       "draft_size_hist": hist if m == "eagle3" else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for w in workers.values():
            w.stop(5)
    result = {"args": vars(a), "dtype": target.meta.get("dtype"), "rows": rows, "policy": policy.info()}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
