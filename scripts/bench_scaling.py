"""Data-scaling curve of the EAGLE-3 head: held-out τ and simulated acceptance vs regenerated tokens.

Reads a finished run's data dir (`eagle3 run --data-dir D`, e.g. the cpu preset's): the train feature
shards of every workload, the eval-split features and the held-out eval prompts. For each size (response
tokens) it links nested subsets of whole shards, taken round-robin across the workloads so every size
mixes them alike, trains a head with one preset (+ overrides), exports it and measures
  - held-out simulated acceptance (eval-split features) and the train-side one,
  - τ by the engine on held-out prompts (MT-bench first turns + each workload's eval prompts), for the
    chain and the tree presets, in the compute dtype the server uses,
  - wall time: training, plus regeneration of that many tokens at --regen-tok-s (the run's measured rate).
Resumable: a point whose results exist is not redone, and training resumes from its checkpoint.
Writes results.json (after every point), scaling.md (table) and scaling.png.

    python scripts/bench_scaling.py --data-dir ~/.cache/eagle3-runs/cpu/data \
        --target ~/.cache/eagle3/prepared/smollm2-135m-instruct --sizes 10000,30000,100000,300000 \
        --preset cpu --out ~/.cache/eagle3-runs/scaling
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")

from safetensors import safe_open  # noqa: E402

from eagle3_platform.features.shards import read_manifest, write_manifest  # noqa: E402
from eagle3_platform.records import WORKLOADS, read_jsonl, write_jsonl_atomic  # noqa: E402


def shards_round_robin(dirs: list[Path]) -> list[dict]:
    """Manifest rows of every train dir (+ path, response tokens), interleaved dir by dir."""
    per_dir = []
    for d in dirs:
        rows = read_manifest(d).to_dicts()
        for r in rows:
            r["path"] = str(d / r["shard"])
            with safe_open(r["path"], framework="pt") as f:
                r["response_tokens"] = int(f.get_tensor("loss_mask").sum())
        per_dir.append(rows)
    out = []
    for i in range(max(map(len, per_dir), default=0)):
        out += [rows[i] for rows in per_dir if i < len(rows)]
    return out


def subset_dir(rows: list[dict], size: int, root: Path) -> tuple[Path, int, int] | None:
    """Link the shortest prefix of `rows` holding >= size response tokens into one feature dir."""
    chosen, total = [], 0
    for r in rows:
        if total >= size:
            break
        chosen.append(r)
        total += r["response_tokens"]
    if total < size:
        return None
    out = root / f"features-{size}"
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for k, r in enumerate(chosen):
        name = f"shard-{k:05d}.safetensors"
        link = out / name
        if not link.exists():
            link.symlink_to(r["path"])
        manifest.append({**{c: r[c] for c in ("samples", "tokens", "sha256", "bytes", "ids")},
                         "shard": name, "uri": name})
    write_manifest(out, manifest)
    return out, total, sum(r["samples"] for r in chosen)


def heldout_prompts(data_dir: Path, out: Path, mtbench: int) -> Path:
    """MT-bench first turns + every workload's eval prompts, as one PromptRecord JSONL."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import mtbench_prompts

    recs = [r.model_dump() for r in mtbench_prompts(mtbench)] if mtbench else []
    for w in WORKLOADS:
        path = data_dir / w / "filtered_prompts" / "eval" / "kept.jsonl"
        if path.exists():
            recs += list(read_jsonl(path))
    write_jsonl_atomic(out, recs)
    return out


def run_point(size: int, feats: Path, args, eval_dirs: list[Path], prompts: Path, target) -> dict:
    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.train import PRESETS, train
    from eagle3_platform.spec.config import PRESETS as SPEC
    from eagle3_platform.spec.eval import evaluate

    cfg = replace(PRESETS[args.preset], **json.loads(args.overrides))
    head, export = args.out / f"head-{size}", args.out / f"export-{size}"
    t0 = time.time()
    summary = train(args.target, [feats], head, cfg, resume=True, eval_dirs=eval_dirs)
    train_s = time.time() - t0
    export_draft(head, export)
    point = {"train_s": train_s, "steps": summary["steps"], "train_config": asdict(cfg),
             "heldout_simulated_acceptance": summary.get("eval_simulated_acceptance"),
             "train_simulated_acceptance": summary.get("train_simulated_acceptance"),
             "heldout_acc_k": (summary.get("eval") or {}).get("acc")}
    for spec in args.spec:
        ev = evaluate(args.target, export, prompts, SPEC[spec], max_new_tokens=args.max_new_tokens,
                      limit=args.limit, target=target)
        point[f"tau_{spec}"] = ev["acceptance_length"]
        point[f"tau_{spec}_by_workload"] = {w: s["acceptance_length"] for w, s in ev["workloads"].items()}
    return point


def write_report(results: list[dict], out: Path, specs: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["response tokens", "samples", "steps", "held-out sim. acceptance",
            *[f"τ {s}" for s in specs], "train min", "data min (regen est.)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join([f"{r['response_tokens']:,}", str(r["samples"]), str(r["steps"]),
                                        f"{r['heldout_simulated_acceptance'] or float('nan'):.2f}",
                                        *[f"{r[f'tau_{s}']:.2f}" for s in specs],
                                        f"{r['train_s'] / 60:.1f}", f"{r['regen_s_est'] / 60:.1f}"]) + " |")
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["response_tokens"] for r in results]
    for s in specs:
        ax.plot(x, [r[f"tau_{s}"] for r in results], marker="o", label=f"τ {s} (engine, held-out)")
    ax.plot(x, [r["heldout_simulated_acceptance"] for r in results], marker="s", linestyle="--",
            label="simulated acceptance (held-out)")
    ax.set_xscale("log")
    ax.set_xlabel("regenerated response tokens")
    ax.set_ylabel("acceptance length")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a finished run's --data-dir")
    ap.add_argument("--target", required=True, help="prepared target dir")
    ap.add_argument("--sizes", required=True, help="response-token sizes, comma-separated, ascending")
    ap.add_argument("--preset", default="cpu", help="training preset")
    ap.add_argument("--overrides", default="{}", help='TrainConfig overrides as JSON, e.g. \'{"lr": 3e-4}\'')
    ap.add_argument("--spec", nargs="+", default=["chain", "tree"])
    ap.add_argument("--mtbench", type=int, default=24, help="MT-bench first turns among the held-out prompts")
    ap.add_argument("--limit", type=int, default=None, help="held-out prompts measured (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--regen-tok-s", type=float, default=200.0, help="the run's regeneration rate")
    ap.add_argument("--dtype", default="auto", help="engine dtype for τ (the server's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from eagle3_platform.compute import set_threads
    from eagle3_platform.target import load_target

    set_threads(0)
    args.out.mkdir(parents=True, exist_ok=True)
    train_dirs = [args.data_dir / w / "features" / "train" for w in WORKLOADS
                  if (args.data_dir / w / "features" / "train" / "manifest.parquet").exists()]
    eval_dirs = [args.data_dir / w / "features" / "eval" for w in WORKLOADS
                 if (args.data_dir / w / "features" / "eval" / "manifest.parquet").exists()]
    rows = shards_round_robin(train_dirs)
    prompts = heldout_prompts(args.data_dir, args.out / "heldout.jsonl", args.mtbench)
    target = load_target(args.target, dtype=args.dtype)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {r["size"] for r in results}
    for size in sorted(int(s) for s in args.sizes.split(",")):
        if size in done:
            continue
        sub = subset_dir(rows, size, args.out)
        if sub is None:
            print(f"[scaling] {size:,} response tokens: more than the run holds "
                  f"({sum(r['response_tokens'] for r in rows):,}); skipped", file=sys.stderr)
            continue
        feats, tokens, samples = sub
        if any(r["response_tokens"] == tokens for r in results):  # shards are the unit: sizes can coincide
            print(f"[scaling] {size:,}: same shards as an earlier point; skipped", file=sys.stderr)
            continue
        print(f"[scaling] {size:,}: {tokens:,} response tokens in {samples} samples", file=sys.stderr, flush=True)
        point = {"size": size, "response_tokens": tokens, "samples": samples,
                 "regen_s_est": tokens / args.regen_tok_s,
                 **run_point(size, feats, args, eval_dirs, prompts, target)}
        results.append(point)
        tmp = results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        os.replace(tmp, results_path)
    if results:
        write_report(sorted(results, key=lambda r: r["size"]), args.out, args.spec)
        print((args.out / "scaling.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
