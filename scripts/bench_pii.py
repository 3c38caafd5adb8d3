"""PII/DLP scanner benchmark on a seeded, Faker-labelled prompt set.

Prints scan throughput (prompts/s, batched `scan_many` and one-at-a-time `scan`, with NER and
pattern-only), per-entity precision/recall, and the false-positive rate on clean prompts by category,
as a table and as JSON (last line). Also shows the given-name trade-off: math word problems with lone
first names, flagged or not, under min_person_tokens = 1 vs 2.

    python scripts/bench_pii.py --per-type 40 --clean 40 --seed 0 [--json-out FILE]

Definitions (prompt-level, span-matched):
  recall(T)    = labelled-T prompts with a type-T finding overlapping the gold span / labelled-T prompts
  caught(T)    = labelled-T prompts with ANY finding overlapping the gold span (the filter drops these)
  precision(T) = type-T findings overlapping the prompt's gold PII span (any type: a LOCATION finding on
                 the city of a labelled address is right) / all type-T findings, clean prompts included
  clean FP     = clean prompts with any finding (the filter would wrongly drop or redact them)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time
from collections import defaultdict
from dataclasses import replace

from faker import Faker

from eagle3_platform.data.pii import PRESETS, PiiScanner

TEMPLATES: dict[str, list[str]] = {
    "PERSON": ["Write a thank-you note to {v} for mentoring me this year.",
               "{v} asked me to review the quarterly report; draft a polite reply.",
               "Can you summarise the email thread between me and {v} about the offsite?",
               "My landlord {v} refuses to return the deposit. What are my options?"],
    "LOCATION": ["Plan a three-day itinerary for {v} in early spring.",
                 "We are opening a new office in {v}; write the announcement.",
                 "I grew up in {v} and want to write a short memoir about it."],
    "EMAIL_ADDRESS": ["Send the invoice to {v} and cc the finance team.",
                      "My login is {v} but the reset link never arrives.",
                      "Draft a reply to {v} declining the meeting."],
    "PHONE_NUMBER": ["Text me at {v} when the build is green.",
                     "The customer left a voicemail from {v}; write a callback script.",
                     "Update my contact phone to {v} in the signature."],
    "CREDIT_CARD": ["My card {v} was charged twice for the same order.",
                    "Is it safe to store {v} in a browser autofill?",
                    "The payment with {v} was declined, write to support."],
    "IBAN_CODE": ["Please wire the deposit to {v} before Friday.",
                  "Is {v} a valid account for a SEPA transfer?"],
    "US_SSN": ["My SSN is {v}; which tax form do I need?",
               "The form asks for a social security number, I typed {v} - is that right?"],
    "IP_ADDRESS": ["Our firewall blocked {v} last night, is that an attack?",
                   "I keep seeing logins from {v} in the auth log."],
    "STREET_ADDRESS": ["Deliver the package to {v} please.",
                       "My new address is {v}, update my profile.",
                       "Write a noise complaint to the neighbours at {v}."],
    "AWS_ACCESS_KEY": ["boto3 fails with aws_access_key_id={v}, why?",
                       "export AWS_ACCESS_KEY_ID={v} does not work in CI."],
    "GCP_API_KEY": ["The Maps request with key={v} returns 403.",
                    "Why is my API key {v} rejected by Firebase?"],
    "GITHUB_TOKEN": ["git clone https://github.com/acme/app with token {v} says bad credentials.",
                     "GITHUB_TOKEN={v} npm publish fails."],
    "OPENAI_API_KEY": ["client = OpenAI(api_key=\"{v}\") returns 401, help.",
                       "I exported OPENAI_API_KEY={v} but the SDK ignores it."],
    "SLACK_TOKEN": ["My bot token {v} stopped posting to the channel."],
    "JWT": ["Decode this token for me: {v}", "The API returns 401 for Authorization: {v}"],
    "PRIVATE_KEY": ["ssh refuses this key, what is wrong?\n{v}", "Convert this key to PKCS8:\n{v}"],
    "URL_CREDENTIALS": ["DATABASE_URL={v} does not connect from the container.",
                        "Why does pip fail with the index {v}?"],
}

CLEAN: dict[str, list[str]] = {
    "code": ["def {f}(xs):\n    return sorted(xs, key=lambda x: x[{n}])[:{m}]  # top {m}\nprint({f}([(1, 2)]))",
             "for i in range({n}):\n    if i % {m} == 0:\n        print(i, i ** 2, hex(i))",
             "SELECT user_id, COUNT(*) FROM events WHERE ts > {n} GROUP BY user_id HAVING COUNT(*) > {m};",
             "Why does `np.zeros(({n}, {m}))` use {k} bytes? I'm on numpy 1.26.{m}.",
             "Fix this: `const {f} = (a, b) => a.map(x => x * {n}).filter(x => x > {m});`"],
    "math": ["Solve for x: {n}x + {m} = {k}.", "What is {n} choose {m}, and {k} modulo 7?",
             "Integrate x^{m} from 0 to {n}.", "A train travels {n} km in {m} hours; average speed?"],
    "versions": ["Upgrade from Python 3.{m}.{n} to 3.12.{m}; torch=={m}.{n}.1 breaks.",
                 "After bumping v{m}.{n}.{k} to v{m}.{n}.{j}, CUDA 12.{m} and driver {k}.{n} mismatch.",
                 "Release {n}.{m} (build {k}) ships on 2024-0{m}-1{m}; summarise the changelog.",
                 "Serve on 127.0.0.1:{k} and the replica on 10.0.{m}.{n}; docs at https://docs.python.org/3/"],
    "prose": ["Explain the difference between TCP and UDP in {m} bullet points.",
              "Write a haiku about garbage collection.", "Summarise the plot of a heist movie in {n} words.",
              "Compare merge sort and quicksort for {k} elements."],
    "math_given_names": ["{a} has {n} apples and gives {m} to {b}. How many does {a} have left?",
                         "{a} reads {n} pages a day. How many days to finish {k} pages?"],
}


def _rand(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def secret(kind: str, rng: random.Random, fake: Faker) -> str:
    up, alnum = string.ascii_uppercase + string.digits, string.ascii_letters + string.digits
    b64 = alnum + "+/"
    if kind == "AWS_ACCESS_KEY":
        return "AKIA" + _rand(rng, up, 16)
    if kind == "GCP_API_KEY":
        return "AIza" + _rand(rng, alnum + "-_", 35)
    if kind == "GITHUB_TOKEN":
        return rng.choice(["ghp_", "gho_", "ghs_"]) + _rand(rng, alnum, 36)
    if kind == "OPENAI_API_KEY":
        return "sk-proj-" + _rand(rng, alnum + "_-", 48)
    if kind == "SLACK_TOKEN":
        return f"xoxb-{_rand(rng, string.digits, 11)}-{_rand(rng, string.digits, 12)}-{_rand(rng, alnum, 24)}"
    if kind == "JWT":
        return "eyJhbGciOiJIUzI1NiJ9.eyJ" + _rand(rng, alnum + "-_", 40) + "." + _rand(rng, alnum + "-_", 43)
    if kind == "PRIVATE_KEY":
        body = "\n".join(_rand(rng, b64, 64) for _ in range(4))
        label = rng.choice(["RSA ", "EC ", "OPENSSH ", ""])
        return f"-----BEGIN {label}PRIVATE KEY-----\n{body}\n-----END {label}PRIVATE KEY-----"
    if kind == "URL_CREDENTIALS":
        scheme = rng.choice(["postgres", "mysql", "redis", "https", "amqp"])
        return f"{scheme}://{fake.user_name()}:{_rand(rng, alnum, 14)}@{fake.domain_name()}:5432/db"
    raise KeyError(kind)


def value(kind: str, fake: Faker, fake_gb: Faker, rng: random.Random) -> str:
    gen = {
        "PERSON": fake.name, "LOCATION": lambda: rng.choice([fake.city, fake.country, fake_gb.city])(),
        "EMAIL_ADDRESS": fake.email, "PHONE_NUMBER": lambda: rng.choice([fake, fake_gb]).phone_number(),
        "CREDIT_CARD": fake.credit_card_number, "IBAN_CODE": fake.iban, "US_SSN": fake.ssn,
        "IP_ADDRESS": fake.ipv4_public,
        "STREET_ADDRESS": lambda: rng.choice([fake.street_address, fake.address, fake_gb.address])(),
    }.get(kind)
    return gen() if gen else secret(kind, rng, fake)


def build(per_type: int, n_clean: int, seed: int) -> list[dict]:
    rng, fake, fake_gb = random.Random(seed), Faker("en_US"), Faker("en_GB")
    fake.seed_instance(seed)
    fake_gb.seed_instance(seed + 1)
    items = []
    for kind, temps in TEMPLATES.items():
        for i in range(per_type):
            v = value(kind, fake, fake_gb, rng)
            t = temps[i % len(temps)]
            pre = t[:t.index("{v}")]
            items.append({"text": t.format(v=v), "label": kind, "span": (len(pre), len(pre) + len(v))})
    for cat, temps in CLEAN.items():
        for i in range(n_clean):
            n, m, k, j = rng.randint(2, 999), rng.randint(1, 9), rng.randint(1000, 9999), rng.randint(0, 99)
            text = temps[i % len(temps)].format(n=n, m=m, k=k, j=j, f=fake.word() + "_fn",
                                                a=fake.first_name(), b=fake.first_name())
            items.append({"text": text, "label": None, "clean": cat, "span": None})
    return items


def overlaps(f, span) -> bool:
    return span is not None and f.start < span[1] and span[0] < f.end


def timed(fn, repeats: int) -> float:
    """Median seconds over repeats, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def evaluate(items: list[dict], findings: list[list]) -> dict:
    kinds = list(TEMPLATES)
    n_lab, hit, caught = defaultdict(int), defaultdict(int), defaultdict(int)
    n_find, good = defaultdict(int), defaultdict(int)
    clean_n, clean_fp, clean_kinds = defaultdict(int), defaultdict(int), defaultdict(lambda: defaultdict(int))
    for it, fs in zip(items, findings):
        if it["label"]:
            n_lab[it["label"]] += 1
            hit[it["label"]] += any(f.entity_type == it["label"] and overlaps(f, it["span"]) for f in fs)
            caught[it["label"]] += any(overlaps(f, it["span"]) for f in fs)
        else:
            clean_n[it["clean"]] += 1
            clean_fp[it["clean"]] += bool(fs)
            for f in fs:
                clean_kinds[it["clean"]][f.entity_type] += 1
        for f in fs:
            n_find[f.entity_type] += 1
            good[f.entity_type] += overlaps(f, it["span"])  # points at real PII (a city inside an address)
    per = {k: {"n": n_lab[k], "recall": hit[k] / n_lab[k], "caught": caught[k] / n_lab[k],
               "findings": n_find[k], "precision": (good[k] / n_find[k]) if n_find[k] else None} for k in kinds}
    clean = {c: {"n": clean_n[c], "fp_rate": clean_fp[c] / clean_n[c], "fp_types": dict(clean_kinds[c])}
             for c in clean_n}
    return {"per_entity": per, "clean": clean}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-type", type=int, default=40)
    ap.add_argument("--clean", type=int, default=40, help="clean prompts per clean category")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="chat,multi_turn,code,math,long_context",
                    help="also run the drop filter on real workload prompts ('' to skip)")
    ap.add_argument("--workload-limit", type=int, default=100)
    ap.add_argument("--workload-split", default="train", choices=("train", "eval"))
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    items = build(args.per_type, args.clean, args.seed)
    texts = [it["text"] for it in items]
    ner, pat = PiiScanner(nlp="auto"), PiiScanner(nlp="none")
    given1 = PiiScanner(nlp="auto", cfg=replace(PRESETS["demo"], min_person_tokens=1))
    res = evaluate(items, ner.scan_many(texts))
    res_pat = evaluate(items, pat.scan_many(texts))
    res_g1 = evaluate(items, given1.scan_many(texts))
    sub = texts[: min(len(texts), 200)]
    speed = {
        "ner_batched": len(texts) / timed(lambda: ner.scan_many(texts), args.repeats),
        "ner_single": len(sub) / timed(lambda: [ner.scan(t) for t in sub], args.repeats),
        "patterns_batched": len(texts) / timed(lambda: pat.scan_many(texts), args.repeats),
    }
    out = {"prompts": len(items), "labelled": sum(1 for i in items if i["label"]), "seed": args.seed,
           "ner_enabled": ner.ner_enabled, "prompts_per_s": {k: round(v, 1) for k, v in speed.items()},
           "ner": res, "patterns_only": res_pat,
           "min_person_tokens_1": {"clean": res_g1["clean"], "PERSON": res_g1["per_entity"]["PERSON"]}}
    out["ratios"] = {"batched_over_single": round(speed["ner_batched"] / speed["ner_single"], 2),
                     "patterns_over_ner": round(speed["patterns_batched"] / speed["ner_batched"], 2)}
    if args.workloads:
        out["workloads"] = bench_workloads(args.workloads.split(","), args.workload_limit, ner, args.workload_split)
    print_table(out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return out


def bench_workloads(workloads: list[str], limit: int, scanner: PiiScanner, split: str = "train") -> dict:
    """The drop filter on real training prompts: what share each workload would lose, and why.
    Unlabelled, so these are flag rates, not false positives (MT-bench-like prompts name real places)."""
    from eagle3_platform.data.filter import filter_records
    from eagle3_platform.data.sources import iter_workload

    out = {}
    for w in workloads:
        rows = [r.model_dump() for r in iter_workload(w, split=split, limit=limit, seed=0)]
        chars = sum(len(m["content"]) for r in rows for m in r["messages"])
        filter_records(rows[:4], scanner=scanner)  # warm-up
        t0 = time.perf_counter()
        _, _, summ = filter_records(rows, scanner=scanner)
        dt = time.perf_counter() - t0
        out[w] = {"split": split, "records": summ["read"], "kept": summ["kept"], "by_reason": summ["by_reason"],
                  "records_per_s": round(summ["read"] / dt, 1), "kchars_per_s": round(chars / dt / 1000, 1),
                  "mean_chars": round(chars / max(len(rows), 1))}
    return out


def _fmt(x) -> str:
    return "  -  " if x is None else f"{x:5.3f}"


def print_table(out: dict) -> None:
    p = sys.stdout.write
    p(f"\n{out['prompts']} prompts ({out['labelled']} labelled), seed {out['seed']}, NER {out['ner_enabled']}\n")
    p("throughput (prompts/s, median): " + ", ".join(f"{k} {v}" for k, v in out["prompts_per_s"].items()) + "\n\n")
    p(f"{'entity':<16}{'n':>4} | {'prec':>6}{'recall':>7}{'caught':>7} | patterns-only {'recall':>6}\n")
    for k, r in out["ner"]["per_entity"].items():
        rp = out["patterns_only"]["per_entity"][k]
        p(f"{k:<16}{r['n']:>4} | {_fmt(r['precision']):>6}{_fmt(r['recall']):>7}{_fmt(r['caught']):>7} | "
          f"{'':>13} {_fmt(rp['recall']):>6}\n")
    p(f"\n{'clean category':<18}{'n':>4} | {'FP rate':>8} {'(min_person_tokens=1)':>22} | FP types\n")
    for c, r in out["ner"]["clean"].items():
        g1 = out["min_person_tokens_1"]["clean"][c]["fp_rate"]
        p(f"{c:<18}{r['n']:>4} | {r['fp_rate']:8.3f} {g1:22.3f} | {r['fp_types']}\n")
    p(f"\nratios (same run): {out['ratios']}\n")
    for w, r in out.get("workloads", {}).items():
        p(f"workload {w:<13} kept {r['kept']:>4}/{r['records']:<4} {r['records_per_s']:>7} rec/s "
          f"{r['kchars_per_s']:>7} kchar/s (mean {r['mean_chars']} chars) rejected: {r['by_reason']}\n")
    p("\n")


if __name__ == "__main__":
    main()
