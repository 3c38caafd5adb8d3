"""Decode speed, batch 1, T=0, on held-out MT-bench prompts (first turn; one per category by default).

Methods, interleaved per prompt within every repeat so machine-load drift hits all of them alike:
  hf_greedy         transformers `generate`, greedy, in --dtype, on the target as load_target gives it
                    (linear layers oneDNN-packed on CPU, as every engine row runs; under `auto` without
                    native bf16, a 4-bit target's narrow matmuls on its codes): the reference
  hf_greedy_stock   the same on the stock model (torch's row-major linear kernels): what `generate`
                    gives a user who loads the checkpoint with transformers alone
  hf_greedy_bf16    the same in bf16 when --dtype is not bf16 and the CPU has it (strongest plain baseline)
  hf_prompt_lookup  transformers `generate(prompt_lookup_num_tokens=...)`, greedy
  engine_baseline   SpecEngine without a draft (plain KV-cached decoding through the engine)
  eagle3_chain      SpecEngine + EAGLE-3 head, `chain` preset      (needs --draft)
  eagle3_tree       SpecEngine + EAGLE-3 head, `tree` preset       (needs --draft)
  eagle3_X_lookupN  the same + a prompt-lookup branch of up to N tokens (--lookup-tokens N ...)
  eagle3_X_policy   the first eagle3 row's engine (its lookup branch: the first --lookup-tokens) with
                    each step's draft size chosen by the server's policy (spec/policy.py; --policy),
                    one policy learning across prompts and repeats as a server's does: what a
                    server gives one request at a time
  lookupN_plain     what a server does at draft size 0 (needs --draft and --lookup-tokens N): plain
                    steps that verify the request's prompt-lookup match alone, the head never run;
                    the row the head's drafts must beat
  eagle3_X_native   the same with the head's weights in bf16, not int8 (--head-weights int8 native)
  eagle3_X_dtN      the same with the head drafting on N threads (--draft-threads 1 N)
  oracle_chain      SpecEngine + a drafter that always proposes the engine's own greedy continuation
                    (chain, depth 4, zero draft cost): the ceiling of the verify machinery (τ = 5)
  oracle_chainN     the same at depth N (--oracle-steps 4 N ...; τ = N + 1): where a verify's cost
                    steps with its width (the 4-bit kernel tiles rows by 4), a shorter chain can win
Reported per method: median over repeats of (Σ tokens / Σ seconds over the prompts), the median of
the per-repeat ratios vs hf_greedy and vs the fastest plain row, τ (engine), the cost of one step in
plain decode steps (engine rows; prefill excluded), greedy-output mismatches vs hf_greedy, and the token
agreement: the share of emitted tokens that plain greedy decoding in the same dtype emits given the same
prefix (exactly 1.0 in fp32; in bf16, or on 4-bit codes, a near-tie may flip when a verify forward
has another shape).

  python scripts/bench_decode.py --target ~/.cache/eagle3/prepared/smollm2-135m-instruct --draft EXPORT_DIR --out bench.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from eagle3_platform.data.chat import render_prompt  # noqa: E402
from eagle3_platform.data.local_gen import common_prefix  # noqa: E402
from eagle3_platform.draft.metrics import acceptance_length  # noqa: E402
from eagle3_platform.model.compute import has_native_bf16, threads  # noqa: E402
from eagle3_platform.model.target import load_target  # noqa: E402
from eagle3_platform.spec.config import HEAD_CONTEXT, HEAD_WEIGHTS, PRESETS, SpecConfig, get_preset  # noqa: E402
from eagle3_platform.spec.engine import SpecEngine  # noqa: E402
from eagle3_platform.spec.eval import first_turn, load_prompts  # noqa: E402
from eagle3_platform.spec.policy import DraftSizePolicy  # noqa: E402
from eagle3_platform.store.records import write_json_atomic  # noqa: E402
from eagle3_platform.store.paths import cache_root  # noqa: E402

EMBEDDED_TARGET = cache_root() / "prepared" / "smollm2-135m-instruct"  # what `eagle3 run` prepares

MTBENCH_PER_CATEGORY = 10  # MT-bench lists 8 categories x 10 questions in order


def mtbench_prompts(n: int) -> list:
    """n MT-bench questions spread over the categories (every 10th question first)."""
    from eagle3_platform.data.sources import iter_workload

    recs = [r for r in iter_workload("multi_turn", split="eval", limit=80) if "mt_bench" in r.source]
    order = sorted(range(len(recs)), key=lambda i: (i % MTBENCH_PER_CATEGORY, i))
    return [recs[i] for i in order[:n]]


def hf_method(target, eos_ids, target_threads=None, **kw):
    @torch.no_grad()
    def run(ids, max_new):
        x = torch.tensor([ids])
        with threads(target_threads):  # all of generate is the target's
            out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                        do_sample=False, eos_token_id=sorted(eos_ids),
                                        pad_token_id=target.tokenizer.pad_token_id, **kw)
        return out[0, len(ids):].tolist(), None
    return run


def engine_method(engine, max_draft_tokens: int | None = None, policy: DraftSizePolicy | None = None):
    """max_draft_tokens: every step's draft cap (None: the preset's; 0: a server's draft size 0, plain
    steps that verify the request's prompt-lookup match, spec/batch.py; the head only queues).
    policy: each step's cap chosen by it and told what it cost, one policy learning across the
    prompts (a server's worker at batch 1, spec/policy.py)."""
    def run(ids, max_new):
        tokens, stats = engine.generate(ids, max_new, max_draft_tokens=max_draft_tokens, policy=policy)
        return tokens, dict(stats)
    return run


def oracle_name(steps: int) -> str:
    return "oracle_chain" if steps == PRESETS["chain"].num_steps else f"oracle_chain{steps}"


def oracle_method(target, refs: dict, target_threads, steps: int):
    """The ceiling of the verify machinery: a zero-cost drafter that always proposes what the engine
    will emit. refs[prompt] starts as hf_greedy's output; `settle_oracle` makes it the engine's own
    output (in bf16 a near-tie can flip between a 5-token verify and a 1-token decode, after which
    hf_greedy's continuation would no longer be what the engine emits). steps: the chain's depth."""
    from eagle3_platform.testing.oracle import OracleDrafter

    cfg = replace(PRESETS["chain"], num_steps=steps, num_draft_tokens=steps + 1)

    def run(ids, max_new):
        oracle = OracleDrafter(refs[tuple(ids)], target.model.config.vocab_size, cfg.num_steps,
                               siblings=False, always_correct=True)
        tokens, stats = SpecEngine(target, oracle, cfg, target_threads).generate(ids, max_new)
        return tokens, dict(stats)
    return run


def settle_oracle(run, refs: dict, prompts: list[list[int]], max_new: int, rounds: int = 4) -> int:
    """Iterate refs <- oracle output until it is a fixed point; returns prompts still unsettled."""
    unsettled = 0
    for ids in prompts:
        for _ in range(rounds):
            tokens, _ = run(ids, max_new)
            if tokens == refs[tuple(ids)][:len(tokens)]:
                break
            refs[tuple(ids)] = tokens
        else:
            unsettled += 1
    return unsettled


def eagle3_config(args, name: str, weights: str) -> SpecConfig:
    """An eagle3 row's settings: the spec preset `name`, the head's weights, --min-draft-prob if given."""
    cfg = replace(get_preset(name), head_weights=weights)
    return cfg if args.min_draft_prob is None else replace(cfg, min_draft_prob=args.min_draft_prob)


def build_methods(target, draft, args, refs: dict, bf16_target=None, stock_target=None, answers=None) -> dict:
    """refs: per oracle row (its name), prompt -> its settled references (filled by warm_up).
    answers: the export's answer n-gram table (draft/answer_ngrams.py); with --answer-tokens N > 0,
    each lookup row (and the policy row) also runs drafting up to N tokens from it (suffix _answersN)."""
    tt = args.target_threads
    variants = [("", 0)] + ([(f"_answers{args.answer_tokens}", args.answer_tokens)] if args.answer_tokens else [])
    base = SpecEngine(target, None, PRESETS["baseline"], tt)
    methods = {"hf_greedy": hf_method(target, base.eos_ids, tt),
               "hf_prompt_lookup": hf_method(target, base.eos_ids, tt,
                                             prompt_lookup_num_tokens=args.prompt_lookup_tokens)}
    if bf16_target is not None:  # the strongest plain baseline when the run itself is not in bf16
        methods["hf_greedy_bf16"] = hf_method(bf16_target, base.eos_ids, tt)
    if stock_target is not None:
        methods["hf_greedy_stock"] = hf_method(stock_target, base.eos_ids, tt)
    methods["engine_baseline"] = engine_method(base)
    if draft is not None:
        for name, weights, dt in itertools.product(args.spec, args.head_weights, args.draft_threads):
            cfg = eagle3_config(args, name, weights)
            # the first value of --head-weights and of --draft-threads is unnamed; the others are
            # named (eagle3_chain_native, eagle3_chain_dt2)
            suffix = ("" if weights == args.head_weights[0] else f"_{weights}") + (
                "" if dt == args.draft_threads[0] else f"_dt{dt}")
            methods[f"eagle3_{name}{suffix}"] = engine_method(SpecEngine(target, draft, cfg, tt, dt))
            for n, (tag, k) in itertools.product(args.lookup_tokens, variants):  # + a lookup branch
                methods[f"eagle3_{name}_lookup{n}{suffix}{tag}"] = engine_method(
                    SpecEngine(target, draft, replace(cfg, lookup_tokens=n, answer_tokens=k), tt, dt, answers))
        if args.policy:  # the server's way: the first row's settings, the draft size chosen per step
            cfg = replace(eagle3_config(args, args.spec[0], args.head_weights[0]),
                          lookup_tokens=args.lookup_tokens[0] if args.lookup_tokens else 0)
            name = f"eagle3_{args.spec[0]}" + (f"_lookup{cfg.lookup_tokens}" if cfg.lookup_tokens else "")
            for tag, k in variants if cfg.lookup_tokens else variants[:1]:
                engine = SpecEngine(target, draft, replace(cfg, answer_tokens=k), tt, args.draft_threads[0], answers)
                policy = DraftSizePolicy(cfg.num_draft_tokens - 1)
                methods[f"{name}_policy{tag}"] = engine_method(engine, policy=policy)
        for n, (tag, k) in itertools.product(args.lookup_tokens, variants):  # the branch alone (draft size 0)
            cfg = replace(get_preset(args.spec[0]), head_weights=args.head_weights[0], lookup_tokens=n,
                          answer_tokens=k)
            methods[f"lookup{n}_plain{tag}"] = engine_method(SpecEngine(target, draft, cfg, tt, None, answers),
                                                             max_draft_tokens=0)
    for steps in args.oracle_steps if args.oracle else ():
        refs[oracle_name(steps)] = {}  # settled per row: a near-tie may flip with the verify's width
        methods[oracle_name(steps)] = oracle_method(target, refs[oracle_name(steps)], tt, steps)
    return methods


def bench(methods: dict, prompts: list[list[int]], args, target) -> dict:
    rows, agreement = [], None  # rows: one per (repeat, prompt, method)
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            for name, run in methods.items():
                t0 = time.perf_counter()
                tokens, stats = run(ids, args.max_new_tokens)
                rows.append({"repeat": r, "prompt": p, "method": name, "tokens": tokens,
                             "seconds": time.perf_counter() - t0, "stats": stats})
            print(f"[bench] repeat {r + 1}/{args.repeats} prompt {p + 1}/{len(prompts)}", file=sys.stderr,
                  flush=True)
        if r == 0:
            agreement = token_agreement(target, rows, prompts, list(methods))
        if args.out:  # partial figures after every repeat: a cut-short run still reports
            partial = {"figures": summarise(rows, list(methods), r + 1, agreement), "repeats_done": r + 1}
            write_json_atomic(args.out, partial, indent=2)
    return summarise(rows, list(methods), args.repeats, agreement)


@torch.no_grad()
def plain_choices(target, prompt: list[int], tokens: list[int]) -> list[int]:
    """Plain greedy decoding's choice at every position of `tokens`, each given the same prefix
    (`tokens` teacher-forced one 1-token decode step at a time, as plain decoding runs)."""
    from eagle3_platform.model.kv_cache import GrowingCache

    cache, model = GrowingCache(), target.model
    logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
    out = []
    for i, tok in enumerate(tokens):
        out.append(int(logits.argmax()))
        if i + 1 < len(tokens):
            logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                           position_ids=torch.tensor([[len(prompt) + i]])).logits[0, -1]
    return out


def token_agreement(target, rows: list[dict], prompts: list[list[int]], names: list[str]) -> dict:
    """Per method: the fraction of emitted tokens that plain greedy decoding in the same dtype emits
    given the same prefix (1.0 = lossless; a bf16 near-tie flip counts once, not for the whole rest)."""
    out, choices = {}, {}  # methods that emit the same tokens share one teacher-forced pass
    for m in names:
        same = total = 0
        for x in rows:
            if x["method"] == m and x["repeat"] == 0:
                key = (x["prompt"], tuple(x["tokens"]))
                if key not in choices:
                    choices[key] = plain_choices(target, prompts[x["prompt"]], x["tokens"])
                want = choices[key]
                same += sum(a == b for a, b in zip(x["tokens"], want))
                total += len(want)
        out[m] = same / max(1, total)
    return out


def summarise(rows: list[dict], names: list[str], repeats: int, agreement: dict | None = None) -> dict:
    def sel(method, r):
        return [x for x in rows if x["method"] == method and x["repeat"] == r]

    def tps(method, r):
        return sum(len(x["tokens"]) for x in sel(method, r)) / sum(x["seconds"] for x in sel(method, r))

    def step_ms(method, r):  # decode time per verify step (prefill excluded)
        s = [x["stats"] for x in sel(method, r)]
        return 1000 * sum(x["total_s"] - x["prefill_s"] for x in s) / max(1, sum(x["verify_steps"] for x in s))

    plain = [m for m in names if m.startswith("hf_greedy")]  # plain decoding: no speculation of any kind
    ref = {x["prompt"]: x["tokens"] for x in rows if x["method"] == "hf_greedy" and x["repeat"] == 0}
    out = {}
    for m in names:
        first = sel(m, 0)
        per_rep = [tps(m, r) for r in range(repeats)]
        fig = {"tok_s_median": statistics.median(per_rep), "tok_s_per_repeat": per_rep,
               "ratio_vs_hf_greedy_median": statistics.median(tps(m, r) / tps("hf_greedy", r)
                                                              for r in range(repeats)),
               # strongest plain baseline: the fastest plain HF `generate` row (any dtype) of the same repeat
               "ratio_vs_best_plain_median": statistics.median(tps(m, r) / max(tps(b, r) for b in plain)
                                                               for r in range(repeats)),
               "tokens": sum(len(x["tokens"]) for x in first),
               "greedy_mismatches_vs_hf": sum(x["tokens"] != ref[x["prompt"]] for x in first),
               # agreement with plain greedy decoding in the same dtype: tokens up to the first
               # difference / all tokens (a flipped near-tie counts the whole rest as disagreement)
               "prefix_agreement_vs_hf": sum(common_prefix(x["tokens"], ref[x["prompt"]]) for x in first)
               / max(1, sum(len(ref[x["prompt"]]) for x in first))}
        if agreement is not None:
            fig["token_agreement"] = agreement[m]
        if first[0]["stats"] is not None:
            decoded = sum(max(0, x["stats"]["generated_tokens"] - 1) for x in first)
            fig["tau"] = acceptance_length(decoded, sum(x["stats"]["verify_steps"] for x in first))
            fig["step_ms_median"] = statistics.median(step_ms(m, r) for r in range(repeats))
            if "engine_baseline" in names:  # one speculative step in units of one plain decode step
                fig["step_cost_vs_decode"] = statistics.median(
                    step_ms(m, r) / step_ms("engine_baseline", r) for r in range(repeats))
        out[m] = fig
    return out


def load_prompt_ids(args, tokenizer) -> list[list[int]]:
    if args.prompts:
        return [ids for _, ids in load_prompts(args.prompts, tokenizer, args.n_prompts)]
    return [render_prompt(tokenizer, first_turn(r)) for r in mtbench_prompts(args.n_prompts)]


def warm_up(methods: dict, prompts: list[list[int]], args, refs: dict) -> None:
    """Allocator, kernels, lazy inits; hf_greedy's outputs become each oracle's starting references
    (refs: oracle row -> prompt -> references)."""
    for ids in prompts:
        greedy = methods["hf_greedy"](ids, args.max_new_tokens)[0]
        for m in refs:
            refs[m][tuple(ids)] = greedy
    for run in methods.values():
        run(prompts[0], 8)
    for m in refs:
        left = settle_oracle(methods[m], refs[m], prompts, args.max_new_tokens)
        if left:
            print(f"[bench] {m} did not settle on {left} prompts", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(EMBEDDED_TARGET),
                    help="prepared target (default: the one `eagle3 run` prepares)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 export dir (omit: no eagle3 rows)")
    ap.add_argument("--prompts", default=None, help="PromptRecord JSONL (default: MT-bench first turns)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared box)")
    ap.add_argument("--target-threads", type=int, default=None,
                    help="torch threads of every target forward, HF generate's included; 0 = every core "
                         "(as the demo/cpu servers run); default: --threads")
    ap.add_argument("--draft-threads", type=int, nargs="+", default=[None],
                    help="torch threads of the head's drafting (SpecEngine draft_threads; 0 = every core, "
                         "as the demo/cpu servers draft); several: one eagle3 row each (A/B). "
                         "Default: --threads")
    ap.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32: every method runs in it")
    ap.add_argument("--spec", nargs="+", default=["chain", "tree"])
    ap.add_argument("--min-draft-prob", type=float, default=None,
                    help="adaptive draft size for the eagle3 rows (default: each spec preset's)")
    ap.add_argument("--head-weights", nargs="+", choices=HEAD_WEIGHTS, default=[SpecConfig.head_weights],
                    help="the head's weights in the engine; several: one eagle3 row each (A/B)")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--lookup-tokens", type=int, nargs="*", default=[],
                    help="also run each eagle3 row with a prompt-lookup branch of this many tokens")
    ap.add_argument("--answer-tokens", type=int, default=0,
                    help="also run each lookup row (and the policy row) drafting up to this many tokens from "
                         "the export's answer n-gram table (draft/answer_ngrams.py; suffix _answersN); 0 = no")
    ap.add_argument("--oracle", action="store_true", help="add the oracle_chain ceiling row")
    ap.add_argument("--oracle-steps", type=int, nargs="+", default=[PRESETS["chain"].num_steps],
                    help="the oracle chains' depths, a row each (oracle_chain = the chain preset's 4)")
    ap.add_argument("--policy", action="store_true",
                    help="add the eagle3_X_policy row: the draft size chosen per step as a server does")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.oracle_steps) < 1:
        ap.error(f"--oracle-steps: a chain of at least 1 draft token, not {min(args.oracle_steps)}")
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    bf16_target = None
    if target.meta["dtype"] != "bfloat16" and has_native_bf16():
        bf16_target = load_target(args.target, dtype="bfloat16")
    stock_target = None  # HF generate on torch's row-major kernels, where the target is packed
    if target.meta["packed_linears"]:
        stock_target = load_target(args.target, dtype=args.dtype, pack=False)
    draft = None
    if args.draft:
        from eagle3_platform.draft.export import load_export
        draft = load_export(args.draft, target)
    prompts = load_prompt_ids(args, target.tokenizer)
    refs: dict = {}
    answers = None
    if args.draft and args.answer_tokens:
        from eagle3_platform.draft.export import load_answer_ngrams
        answers = load_answer_ngrams(args.draft)
        if answers is None:
            raise SystemExit(f"--answer-tokens: {args.draft} has no answer n-gram table (train the head again)")
    methods = build_methods(target, draft, args, refs, bf16_target, stock_target, answers)
    warm_up(methods, prompts, args, refs)
    figures = bench(methods, prompts, args, target)
    result = {"figures": figures, "config": {**vars(args), "n_prompts": len(prompts),
                                             "answer_ngrams": len(answers) if answers is not None else None,
                                             "dtype": target.meta["dtype"],
                                             "int4_rows": target.meta.get("int4_rows", 0),
                                             "torch_threads": torch.get_num_threads(),
                                             "target_threads": args.target_threads,
                                             "head_context": HEAD_CONTEXT,
                                             "loadavg": os.getloadavg()},
              "command": " ".join(sys.argv)}
    int4 = target.meta.get("int4_rows", 0)
    print(f"dtype {target.meta['dtype']}" + (f" (matmuls below {int4} rows on the 4-bit codes)" if int4 else "")
          + f", {torch.get_num_threads()} threads (target: "
          f"{args.target_threads if args.target_threads is not None else 'same'}), load {os.getloadavg()[0]:.2f}"
          + (f", the head drafting over the {HEAD_CONTEXT}" if args.draft else ""))
    for m, f in figures.items():
        print(f"{m:18s} tok/s {f['tok_s_median']:7.2f}  x{f['ratio_vs_hf_greedy_median']:.2f} vs hf_greedy"
              f"  x{f['ratio_vs_best_plain_median']:.2f} vs best plain  tau {f.get('tau', float('nan')):.2f}"
              f"  step {f.get('step_cost_vs_decode', float('nan')):.2f}x decode"
              f"  agreement {f.get('token_agreement', float('nan')):.3f}")
    if args.out:
        write_json_atomic(args.out, result, indent=2)
    print(json.dumps({m: {k: round(v, 3) for k, v in f.items() if isinstance(v, float)}
                      for m, f in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
