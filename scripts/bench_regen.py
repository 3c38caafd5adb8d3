"""Regeneration throughput through `regenerate_file`: a preset's path vs a reference path.

Reference `turn1_demo_path` (default): fp32, batches of 8, 1 torch thread, torch's row-major linear
kernels (the path without model/packed_linear.py; its decode steps, like every path's, go through the engine's
step forward, which makes it ~4% faster than transformers': the ratio errs low); the preset's path is
its dtype (auto = bf16 where the CPU has it), length-planned batches and its thread count. With
`--reference no_cache_reuse`: the preset's path with every turn re-prefilling its history (multi-turn
KV cache reuse off). Same prompts (train prompts of `--workload` from `eagle3 sources`), same greedy
budget, no time budget (every prompt answered in full: a preset's budget would cut the slower path's
run short), in one process; the paths alternate which goes first per repeat. Response PII scanning
is off: this measures generation. With `--reference bf16_only`: the preset's path with dtype pinned to
bfloat16, so every matmul stays bf16 (no fp32 copies for wide ones: compute.wide_matmul_rows). With
`--reference pinned_dtype`: the preset's path with dtype pinned to what `auto` resolves to, so every
matmul runs on the packed weights (no fp32 copies for wide ones, no row-major ones for few rows:
compute.narrow_matmul_rows).

    python scripts/bench_regen.py --target PREPARED_TARGET --prompts 64 --preset demo
    python scripts/bench_regen.py --workload multi_turn --prompts 48 --preset cpu --reference no_cache_reuse
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from eagle3_platform.data.regenerate import PRESETS, regenerate_file  # noqa: E402
from eagle3_platform.data.sources import iter_workload  # noqa: E402
from eagle3_platform.model.compute import resolve_dtype  # noqa: E402
from eagle3_platform.model.target import SMOLLM2, prepare_target  # noqa: E402
from eagle3_platform.store.paths import cache_root  # noqa: E402
from eagle3_platform.store.records import write_jsonl_atomic  # noqa: E402


def write_prompts(path: Path, n: int, workload: str) -> None:
    recs = [r for r in iter_workload(workload, split="train", limit=n, seed=0)]
    write_jsonl_atomic(path, recs)


def run(target_dir, prompts: Path, cfg, work: Path, name: str) -> tuple[float, dict]:
    out = work / f"{name}.jsonl"
    for p in (out, out.with_name(out.stem + ".rejected.jsonl")):
        p.unlink(missing_ok=True)
    s = regenerate_file(target_dir, prompts, out, cfg, scanner=False)
    return s["tok_per_s"], s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="prepared target dir (default: prepare SmolLM2 into the cache)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--reference", default="turn1_demo_path", choices=["turn1_demo_path", "no_cache_reuse", "bf16_only", "pinned_dtype"])
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the preset's")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="optional JSON results file")
    a = ap.parse_args(argv)

    target_dir = a.target or str(cache_root() / "bench-smollm2")
    if a.target is None:
        prepare_target(SMOLLM2, target_dir)
    # No time budget: both paths answer every prompt in full (the demo's 45 s budget would cut the slower
    # path's run short, and a rate over a cut run is not the same work).
    new = replace(PRESETS[a.preset], time_budget_s=None)
    if a.max_new_tokens:
        new = replace(new, max_new_tokens=a.max_new_tokens)
    ref = a.reference
    if ref == "turn1_demo_path":
        old = replace(new, dtype="float32", batch_size=8, torch_threads=1, packed_linears=False)
    elif ref == "bf16_only":
        old = replace(new, dtype="bfloat16")
    elif ref == "pinned_dtype":
        old = replace(new, dtype=resolve_dtype(new.dtype))
    else:
        old = replace(new, reuse_turn_cache=False)
    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, a.prompts, a.workload)
    rates: dict[str, list[float]] = {ref: [], f"{a.preset}_path": []}
    cfgs = {ref: old, f"{a.preset}_path": new}
    summaries = {}
    for r in range(a.repeats):
        names = list(cfgs) if r % 2 == 0 else list(cfgs)[::-1]
        for name in names:
            rate, summaries[name] = run(target_dir, prompts, cfgs[name], work, name)
            rates[name].append(rate)
            print(f"[bench] repeat {r}: {name:16s} {summaries[name]['new_tokens']} tokens, {rate:.1f} tok/s",
                  file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med[f"{a.preset}_path"] / med[ref]
    result = {"prompts": a.prompts, "workload": a.workload, "configs": {k: asdict(v) for k, v in cfgs.items()},
              "tok_per_s_median": med, "tok_per_s_all": rates, "speedup": ratio,
              "loadavg": os.getloadavg()}
    tokens = {k: s["new_tokens"] for k, s in summaries.items()}
    result.update(new_tokens=tokens, written={k: s["written"] for k, s in summaries.items()},
                  rejected={k: s["by_reason"] for k, s in summaries.items()})
    print(f"{ref} {med[ref]:.1f} tok/s | {a.preset} path "
          f"{med[f'{a.preset}_path']:.1f} tok/s | x{ratio:.2f} (load {os.getloadavg()[0]:.2f}; "
          f"new tokens {tokens[ref]} / {tokens[f'{a.preset}_path']})")
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
