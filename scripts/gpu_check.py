"""The device check behind scripts/gpu_check.sh: on the tiny random target, each GPU path against the
CPU, with the torch the machine has and nothing downloaded.

Steps (each timed on both devices; ratio = CPU seconds / device seconds):
- regenerate: regenerate_file, local, greedy, on `--device` as `eagle3 regenerate --device` runs it (the
  summary must name that device; its target load is timed too); answer tokens agreeing with the CPU's;
- extract: features.extract.compute_features (single device); max |device - CPU| of the hidden states;
- train: draft.train.train, the tiny preset's recipe; final loss on both;
- decode: the embedded server's engine (build_engine on `device`, as `eagle3 serve --device` builds it:
  chain drafting, a random head) against its baseline on the same device: lossless means the same
  tokens; one sampled generation too (its RNG draws on the device).
`--device cpu` runs the same steps with the CPU on both sides (a dry run of the logic, ratios ~1).
Prints one line per step and a JSON summary last; exit 1 when a lossless or agreement check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

N_PROMPTS, NEW_TOKENS = 4, 16


def timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts()]


def texts() -> list[str]:
    return [f"Question {i}: what does a mutex protect against, in {i + 3} words?" for i in range(N_PROMPTS)]


def regenerate(tdir: Path, work: Path, device: str) -> list[list[int]]:
    """Local regeneration on `device` through regenerate_file -> each record's answer tokens."""
    from eagle3_platform.data.regenerate import PRESETS, regenerate_file
    from eagle3_platform.store.records import read_jsonl

    inp = work / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "workload": "chat", "source": "gpu-check", "license": "mit",
                                       "messages": [{"role": "user", "content": t}], "n_chars": len(t)}) + "\n"
                           for i, t in enumerate(texts())))
    out = work / f"regen-{device.replace(':', '')}.jsonl"
    cfg = replace(PRESETS["tiny"], max_new_tokens=NEW_TOKENS, device=device, torch_threads=0, progress_every_s=600.0)
    summary = regenerate_file(tdir, inp, out, cfg, scanner=False, restart=True)
    if summary["device"] != device or summary["written"] != N_PROMPTS:
        raise AssertionError(f"regeneration on {device}: summary {summary}")
    records = sorted(read_jsonl(out), key=lambda r: r["id"])  # p0.. in the prompts' order
    return [[t for t, m in zip(r["input_ids"], r["loss_mask"]) if m] for r in records]


def extract(target, samples):
    from eagle3_platform.features.extract import PRESETS, compute_features

    return compute_features(target, samples, replace(PRESETS["tiny"], dtype="float32"))


def engines(tdir: Path, export: Path, device: str):
    """(EAGLE-3 engine, baseline engine) as `eagle3 serve --device` builds them (fp32: lossless is exact)."""
    from eagle3_platform.serve.server import build_engine

    (spec, _, info), (plain, _, _) = (build_engine(tdir, d, "chain", dtype="float32", device=device)
                                      for d in (export, None))
    if info["device"] != str(spec.device) or spec.device.type != device.split(":")[0]:
        raise AssertionError(f"engine on {spec.device}, info {info['device']}, asked for {device}")
    return spec, plain


def decode(spec, plain, ids):
    """(speculative tokens, plain greedy tokens) per prompt, and one sampled generation's length."""
    sampled = spec.generate(ids[0], NEW_TOKENS, temperature=0.8, seed=0)[0]
    return [spec.generate(p, NEW_TOKENS)[0] for p in ids], [plain.generate(p, NEW_TOKENS)[0] for p in ids], len(sampled)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (cpu: a dry run of the logic)")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir)")
    a = ap.parse_args(argv)
    from eagle3_platform.draft.train import PRESETS as TRAIN, train
    from eagle3_platform.model.target import TINY, load_target, prepare_target
    from eagle3_platform.testing.serve import random_export
    from eagle3_platform.testing.synthetic import target_features

    dev = a.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print(f"[gpu-check] torch {torch.__version__} sees no CUDA device (use --device cpu for a dry run)")
        return 2
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu-check-"))
    tdir = work / "tiny-target"
    prepare_target(TINY, tdir)
    print(f"[gpu-check] torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.startswith("cuda") else " (dry run)"), flush=True)
    targets = {d: load_target(tdir, device=d) for d in ("cpu", dev)}
    ids = prompts(targets["cpu"].tokenizer)
    results, ok = {}, True

    def step(name, fn, compare):
        nonlocal ok
        (out_cpu, t_cpu), (out_dev, t_dev) = (timed(lambda d=d: fn(d), d) for d in ("cpu", dev))
        check = compare(out_cpu, out_dev)
        ok &= check.pop("ok", True)
        results[name] = {"cpu_s": round(t_cpu, 3), "device_s": round(t_dev, 3),
                         "ratio_cpu_over_device": round(t_cpu / t_dev, 2) if t_dev else None, **check}
        print(f"[gpu-check] {name}: " + json.dumps(results[name]), flush=True)

    def agree(x, y):
        same = sum(a_ == b_ for u, v in zip(x, y) for a_, b_ in zip(u, v))
        total = sum(min(len(u), len(v)) for u, v in zip(x, y))
        return {"tokens_agreeing": f"{same}/{total}", "ok": total > 0 and same >= 0.9 * total}

    answers = {}

    def regenerate_on(d):
        answers[d] = regenerate(tdir, work, d)
        return answers[d]

    step("regenerate", regenerate_on, agree)
    feats = target_features(tdir, work / "features", n_samples=12)
    samples = [{"input_ids": p + q} for p, q in zip(ids, answers["cpu"])]

    def hidden_diff(x, y):
        diff = max(float((u["aux_hidden"] - v["aux_hidden"]).abs().max()) for u, v in zip(x, y))
        return {"max_abs_diff": diff, "ok": diff < 1e-3}

    step("extract", lambda d: extract(targets[d], samples), hidden_diff)

    def train_on(d):
        cfg = replace(TRAIN["tiny"], device=d)
        return train(tdir, [str(feats)], work / f"train-{d.replace(':', '')}", cfg)["history"][-1]["loss"]

    step("train", train_on, lambda x, y: {"final_loss_cpu": round(x, 4), "final_loss_device": round(y, 4),
                                          "ok": abs(x - y) < 0.05 * max(abs(x), 1e-6) + 1e-3})
    export = random_export(tdir, work / "export")

    def lossless(x, y):
        same = all(s == p for s, p in zip(*y[:2]))
        return {"lossless_on_device": same, "lossless_on_cpu": all(s == p for s, p in zip(*x[:2])),
                "sampled_tokens_on_device": y[2], "ok": same and y[2] > 0}

    built = {d: engines(tdir, export, d) for d in ("cpu", dev)}
    step("decode", lambda d: decode(*built[d], ids), lossless)
    print(json.dumps({"ok": bool(ok), "device": dev, "torch": torch.__version__, "steps": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
