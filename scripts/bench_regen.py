"""Regeneration throughput: the local batched path vs a plain per-prompt `model.generate` loop.

Same target, same prompts, same greedy budget, in one process: warm-up first, then `--repeats` rounds
alternating which path goes first; prints the median tokens/s of each, their ratio, and whether the
two paths produced identical tokens (they must: batching may not change greedy output).

    python scripts/bench_regen.py --target /tmp/t/smol --prompts 16 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from eagle3_platform.data.chat import end_of_turn, render_prompt  # noqa: E402
from eagle3_platform.data.local_gen import generate_batch  # noqa: E402
from eagle3_platform.data.regenerate import PRESETS  # noqa: E402
from eagle3_platform.target import SMOLLM2, load_target, prepare_target  # noqa: E402

FALLBACK_PROMPTS = [  # ShareGPT-like, used only when the sharegpt source is unavailable
    "Can you explain how a hash map works?", "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?", "How do I reverse a linked list in Python?",
    "Give me three tips for a job interview.", "Summarize the plot of Romeo and Juliet.",
    "What is the difference between TCP and UDP?", "Suggest a healthy breakfast for a busy morning.",
    "Explain photosynthesis to a ten-year-old.", "How can I improve my sleep?",
    "Write an email asking my manager for a day off.", "What is a closure in JavaScript?",
    "Translate 'good morning, how are you?' into French.", "Why is the sky blue?",
    "List the planets of the solar system in order.", "How does compound interest work?",
]


def load_prompts(n: int, fits) -> tuple[list[str], str]:
    """n ShareGPT chat prompts that fit the regeneration budget (`fits(text)`), in source order."""
    try:
        from eagle3_platform.data.sources import iter_workload

        texts = []
        for r in iter_workload("chat", split="train", limit=50 * n, seed=0):
            text = next((m.content for m in r.messages if m.role == "user"), "")
            if text.strip() and fits(text):
                texts.append(text)
            if len(texts) == n:
                return texts, "sharegpt (eagle3 sources chat/train)"
    except Exception as e:  # noqa: BLE001 - the benchmark still runs on the built-in prompts
        print(f"[bench] sharegpt source unavailable ({type(e).__name__}); built-in prompts", file=sys.stderr)
    return (FALLBACK_PROMPTS * (n // len(FALLBACK_PROMPTS) + 1))[:n], "built-in"


def run_loop(model, prompts, max_new, stop, pad) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=sorted(stop), pad_token_id=pad)
        outs.append(out[0, len(p):].tolist())
    return outs, time.perf_counter() - t0


def run_batched(model, prompts, max_new, stop, pad, batch_size) -> tuple[list[list[int]], float]:
    """What regenerate's local path does: sort by prompt length, decode batches."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for s in range(0, len(order), batch_size):
        idx = order[s: s + batch_size]
        for i, g in zip(idx, generate_batch(model, [prompts[i] for i in idx], [max_new] * len(idx), stop, pad)):
            outs[i] = g.tokens
    return outs, time.perf_counter() - t0


def trim(tokens: list[int], stop: set[int]) -> list[int]:
    """HF generate pads finished rows; compare up to and including the first stop token."""
    for k, t in enumerate(tokens):
        if t in stop:
            return tokens[: k + 1]
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="prepared target dir (default: prepare SmolLM2 into the cache)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=PRESETS["demo"].batch_size)
    ap.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="skip longer prompts (the demo budget rejects long ones before regeneration anyway)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared/oversubscribed box 2 threads ran 6-8x slower)")
    ap.add_argument("--out", default=None, help="optional JSON results file")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    target_dir = a.target or str(Path.home() / ".cache" / "eagle3" / "bench-smollm2")
    if a.target is None:
        prepare_target(SMOLLM2, target_dir)
    t = load_target(target_dir)
    tok, model = t.tokenizer, t.model
    encode = lambda x: render_prompt(tok, [{"role": "user", "content": x}])  # noqa: E731
    texts, origin = load_prompts(a.prompts, lambda x: len(encode(x)) <= a.max_prompt_tokens)
    prompts = [encode(x) for x in texts]
    stop = {tok.convert_tokens_to_ids(end_of_turn(tok)), tok.eos_token_id}
    pad = tok.pad_token_id
    print(f"[bench] {t.meta['target_id']}: {len(prompts)} prompts ({origin}), prompt tokens "
          f"{min(map(len, prompts))}..{max(map(len, prompts))}, {a.max_new_tokens} new tokens greedy, "
          f"batch {a.batch_size}, threads {a.threads}", file=sys.stderr)

    run_loop(model, prompts[:2], 8, stop, pad)  # warm-up both paths
    run_batched(model, prompts[:4], 8, stop, pad, a.batch_size)
    rates = {"generate_loop": [], "batched": []}
    match = None
    for r in range(a.repeats):
        order = ("generate_loop", "batched") if r % 2 == 0 else ("batched", "generate_loop")
        outs = {}
        for name in order:
            if name == "generate_loop":
                outs[name], dt = run_loop(model, prompts, a.max_new_tokens, stop, pad)
            else:
                outs[name], dt = run_batched(model, prompts, a.max_new_tokens, stop, pad, a.batch_size)
            n = sum(len(trim(o, stop)) for o in outs[name])
            rates[name].append(n / dt)
            print(f"[bench] round {r}: {name:13s} {n} tokens in {dt:.1f}s = {n / dt:.1f} tok/s", file=sys.stderr)
        same = sum(trim(x, stop) == trim(y, stop) for x, y in zip(outs["generate_loop"], outs["batched"]))
        match = same if match is None else min(match, same)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"target_id": t.meta["target_id"], "prompts": len(prompts), "prompt_origin": origin,
              "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "threads": a.threads,
              "repeats": a.repeats, "tok_per_s_median": {k: round(v, 2) for k, v in med.items()},
              "tok_per_s_all": {k: [round(x, 2) for x in v] for k, v in rates.items()},
              "speedup_batched_vs_loop": round(med["batched"] / med["generate_loop"], 2),
              "identical_outputs": f"{match}/{len(prompts)}"}
    print(f"generate loop: {med['generate_loop']:.1f} tok/s | batched: {med['batched']:.1f} tok/s | "
          f"ratio {result['speedup_batched_vs_loop']:.2f}x | identical greedy outputs {match}/{len(prompts)}")
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
