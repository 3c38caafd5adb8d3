"""Batched decoding in process (no HTTP, no Locust): output tokens/s vs batch size, T=0, held-out
MT-bench prompts, and batch invariance in the compute dtype.

For each batch size B, B prompts (cycled) are decoded together from a fresh batch, --max-new tokens
each; rows leave when they end; timings include the prefill (as `generate`'s do). Methods, interleaved per repeat:
  hf_generate   transformers `generate` on the left-padded batch (the strongest plain baseline)
  baseline      the server's engine without a draft (plain decoding, continuous batch)
  eagle3        + the EAGLE-3 head, draft size chosen per step by the server's policy (spec/policy.py)
  eagle3_kN     + the head, draft size fixed at N (--fixed)
Reported per (B, method): median tokens/s over repeats, the ratio to hf_generate and to baseline at
the same B, the mean draft size and τ. Batch invariance (--invariance): every request decoded in a
batch of the largest size vs alone, per method: the share of requests whose output differs and the
share of tokens before the first difference (exact in fp32; bf16 kernels are not batch-invariant).

  python scripts/bench_batch.py --target T --draft EXPORT --batch-sizes 1,2,4,8,16 --out batch.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench_decode import mtbench_prompts  # noqa: E402

from eagle3_platform.data.chat import render_prompt  # noqa: E402
from eagle3_platform.model.compute import threads  # noqa: E402
from eagle3_platform.model.target import load_target  # noqa: E402
from eagle3_platform.spec.config import get_preset  # noqa: E402
from eagle3_platform.spec.engine import SpecEngine  # noqa: E402
from eagle3_platform.spec.eval import first_turn  # noqa: E402
from eagle3_platform.spec.policy import DraftSizePolicy, policy_step  # noqa: E402


def run_engine(engine, prompts, max_new, draft_size=None, policy=None):
    """-> (outputs, seconds, row steps, draft sizes chosen): one continuous batch over `prompts`;
    row steps = verify steps summed over the rows (τ = tokens after the first / row steps)."""
    t0, batch = time.perf_counter(), engine.batch()
    reqs = [batch.open(ids, max_new) for ids in prompts]
    outs = {r: batch.prefill(r, None) for r in reqs}
    steps, sizes = 0, []
    while batch.rows:
        k, out = policy_step(policy, batch, draft_size)
        for r, toks in out:
            outs[r] += toks
        steps, sizes = steps + len(out), sizes + [k or 0]
        for r in [r for r in batch.rows if r.done]:
            batch.close(r)
    return [outs[r] for r in reqs], time.perf_counter() - t0, steps, sizes


@torch.no_grad()
def run_hf(target, eos_ids, prompts, max_new):
    tok = target.tokenizer
    T = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = target.model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                eos_token_id=sorted(eos_ids), pad_token_id=pad)
    seconds = time.perf_counter() - t0
    outs = []
    for row in out[:, T:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        outs.append(row[:cut])
    return outs, seconds


def agreement(batched: list[list[int]], alone: list[list[int]]) -> dict:
    """Share of requests whose output differs, and of tokens before the first difference."""
    differ, same_prefix, total = 0, 0, 0
    for a, b in zip(batched, alone):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        differ += a != b
        same_prefix, total = same_prefix + n, total + max(len(a), len(b))
    return {"requests_differing": differ / len(alone), "token_agreement": same_prefix / max(total, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="exported EAGLE-3 head (omit: plain decoding only)")
    ap.add_argument("--spec", default="chain_adaptive_lookup", help="spec preset (the cpu servers')")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=16, help="held-out MT-bench prompts (cycled)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fixed", default="", help="fixed draft sizes to compare, e.g. 1,4")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the head and the rest (the servers': 1)")
    ap.add_argument("--target-threads", type=int, default=None,
                    help="torch threads of the target's forwards and of hf_generate; 0 = every core "
                         "(the demo/cpu servers'); default: --threads")
    ap.add_argument("--draft-threads", type=int, default=None,
                    help="torch threads of the head's drafting; 0 = every core (the demo/cpu "
                         "servers'); default: --threads")
    ap.add_argument("--invariance", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = load_target(a.target, dtype=a.dtype)
    draft = None
    if a.draft:
        from eagle3_platform.draft.export import load_export
        draft = load_export(a.draft, target)
    base = SpecEngine(target, None, get_preset("baseline"), a.target_threads)
    eagle = (SpecEngine(target, draft, get_preset(a.spec), a.target_threads, a.draft_threads)
             if draft is not None else None)
    prompts = [render_prompt(target.tokenizer, first_turn(r)) for r in mtbench_prompts(a.prompts)]
    sizes = [int(s) for s in a.batch_sizes.split(",")]
    fixed = [int(k) for k in a.fixed.split(",") if k]
    policy = DraftSizePolicy(eagle.cfg.num_draft_tokens - 1) if eagle else None  # learns across cells
    run_engine(base, prompts[:2], 8)  # warm-up
    rows = []
    for B in sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(B)]
        methods = {"hf_generate": None, "baseline": (base, None, None)}
        if eagle is not None:
            methods["eagle3"] = (eagle, None, policy)
            methods.update({f"eagle3_k{k}": (eagle, k, None) for k in fixed})
        samples = {m: [] for m in methods}
        for _ in range(a.repeats):
            for name, spec in methods.items():
                if spec is None:
                    with threads(a.target_threads):  # all of generate is the target's
                        outs, seconds = run_hf(target, base.eos_ids, batch_prompts, a.max_new)
                    steps, chosen = None, []
                else:
                    outs, seconds, steps, chosen = run_engine(spec[0], batch_prompts, a.max_new, spec[1], spec[2])
                n = sum(len(o) for o in outs)
                samples[name].append({"tok_s": n / seconds, "tokens": n, "steps": steps,
                                      "draft_size": statistics.mean(chosen) if chosen else None})
        hf, bl = (statistics.median(s["tok_s"] for s in samples[m]) for m in ("hf_generate", "baseline"))
        for name, ss in samples.items():
            tok_s = statistics.median(s["tok_s"] for s in ss)
            steps = ss[-1]["steps"]
            row = {"batch": B, "method": name, "tok_s": round(tok_s, 1),
                   "vs_hf_generate": round(tok_s / hf, 3), "vs_baseline": round(tok_s / bl, 3),
                   "mean_draft_size": ss[-1]["draft_size"],
                   "tau": round((ss[-1]["tokens"] - B) / steps, 3) if steps else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"args": vars(a), "rows": rows}
    if a.invariance:
        B = max(sizes)
        batch_prompts = [prompts[i % len(prompts)] for i in range(B)]
        result["invariance"] = {}
        for name, engine in (("baseline", base), ("eagle3", eagle)):
            if engine is None:
                continue
            together = run_engine(engine, batch_prompts, a.max_new, None, policy if engine is eagle else None)[0]
            alone = [run_engine(engine, [p], a.max_new)[0][0] for p in batch_prompts]
            result["invariance"][name] = {"batch": B, **agreement(together, alone)}
            print(json.dumps({"invariance": name, **result["invariance"][name]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
