"""Extraction cost vs a plain target forward, and bytes/token on disk vs the 8·H budget.

    python scripts/bench_extract.py [--target ~/.cache/eagle3/prepared/smollm2-135m-instruct] [--conv CONV.jsonl] [--n 16] [--repeats 5]

Same run, same inputs, interleaved repeats after a warm-up, medians:
- plain:    `model(input_ids)` per conversation (the baseline the goal refers to, logits included)
- decoder:  `model.model(input_ids)` per conversation (no lm_head: what extraction must run)
- extract:  `extract_file` end to end (read + validate records, forward with capture, bf16 cast,
            shard writing with fsync + sha256, manifest), one conversation per forward (demo preset)
- extract_batched: the same with padded length-sorted batches (batch_tokens), to pick the preset.
Without --conv, builds --n ChatML conversations with the target's template (data.chat.render).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_platform.features.extract import PRESETS, extract_file, load_records, target_header  # noqa: E402
from eagle3_platform.model.target import load_target  # noqa: E402
from eagle3_platform.store.records import ConversationRecord, write_jsonl_atomic  # noqa: E402
from eagle3_platform.store.paths import cache_root  # noqa: E402

EMBEDDED_TARGET = cache_root() / "prepared" / "smollm2-135m-instruct"  # what `eagle3 run` prepares

TOPICS = ["sorting algorithms", "the French revolution", "photosynthesis", "compound interest",
          "binary search trees", "the water cycle", "HTTP caching", "prime numbers"]


def build_conversations(target, n: int) -> list[ConversationRecord]:
    from eagle3_platform.data.chat import render, template_hash

    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        answer = " ".join([f"Here is a short explanation of {topic}, part {k + 1}: it matters because "
                           f"it shows up in everyday problems and in exams." for k in range(2 + 3 * (i % 4))])
        msgs = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Explain {topic} to me. " * (1 + i % 3)},
                {"role": "assistant", "content": answer}]
        if i % 2:
            msgs += [{"role": "user", "content": "Can you give an example?"},
                     {"role": "assistant", "content": f"Sure. A classic example of {topic} is the one "
                                                      "from the textbook, worked step by step."}]
        ids, mask = render(target.tokenizer, msgs)
        out.append(ConversationRecord(id=f"bench{i:03d}", workload="chat", source="bench",
                                      license="none", messages=msgs, input_ids=ids, loss_mask=mask,
                                      template_hash=template_hash(target.tokenizer),
                                      target_id=target.meta["target_id"]))
    return out


@torch.inference_mode()
def forward_all(fn, seqs: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    for ids in seqs:
        fn(ids)
    return time.perf_counter() - t


def timed_extract(target, target_dir, conv, cfg, work: Path) -> tuple[float, dict]:
    out = work / f"feat-{time.monotonic_ns()}"
    t = time.perf_counter()
    summary = extract_file(target_dir, conv, out, cfg, target=target)
    dt = time.perf_counter() - t
    shutil.rmtree(out)
    return dt, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(EMBEDDED_TARGET),
                    help="prepared target (default: the one `eagle3 run` prepares)")
    ap.add_argument("--conv", default=None, help="conversation records; built when absent")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    conv = Path(args.conv) if args.conv else work / "conv.jsonl"
    if not args.conv:
        write_jsonl_atomic(conv, build_conversations(target, args.n))
    cfg = PRESETS["demo"]
    samples, _, _ = load_records(conv, target_header(target, cfg), cfg.max_length)
    seqs = [torch.tensor([s["input_ids"]]) for s in samples]  # [1,T] each, exactly what extraction sees
    runs = {
        "plain": lambda: forward_all(lambda x: target.model(x), seqs),
        "decoder": lambda: forward_all(lambda x: target.model.model(x), seqs),
        "extract": lambda: timed_extract(target, args.target, conv, cfg, work)[0],
        "extract_batched": lambda: timed_extract(
            target, args.target, conv, replace(cfg, batch_tokens=args.batch_tokens), work)[0],
    }
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved so machine-load drift hits every variant alike
        for k, fn in runs.items():
            times[k].append(fn())
    med = {k: statistics.median(v) for k, v in times.items()}
    _, summary = timed_extract(target, args.target, conv, cfg, work)
    H = target.meta["hidden_size"]
    result = {
        "target": target.meta["target_id"], "conversations": len(seqs), "tokens": summary["tokens"],
        "threads": args.threads, "repeats": args.repeats,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "ratio_extract_vs_plain_forward": round(med["extract"] / med["plain"], 3),
        "ratio_extract_batched_vs_plain_forward": round(med["extract_batched"] / med["plain"], 3),
        "ratio_extract_vs_decoder_forward": round(med["extract"] / med["decoder"], 3),
        "bytes_per_token": summary["bytes_per_token"], "budget_8H": 8 * H,
        "bytes_per_token_over_8H": round(summary["bytes_per_token"] / (8 * H), 4),
    }
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
