"""`eagle3 run`: the whole graph through Dagster. The flags are declared and checked here; the parsed
flags go, as one JSON argument, to `python -m assets.launch` (beside the Dagster definitions), which
materializes what Dagster reports missing or stale. It runs as a child process because this library
never imports Dagster; its output is streamed through."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eagle3_platform.cli.summary import run_with_summary
from eagle3_platform.store.checks import output_dir

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # eagle3_platform/cli/run.py -> the checkout
LAUNCHER = "assets.launch"
# The child reads these at import (presidio's suffix list, the HF hub): offline unless the caller says so.
CHILD_ENV = {"TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS": "", "HF_HUB_OFFLINE": "1", "DAGSTER_DISABLE_TELEMETRY": "1",
             "TOKENIZERS_PARALLELISM": "false"}
KEEP_SERVING_ENV = "EAGLE3_KEEP_SERVING"  # the serving resource's keep_running (resources/__init__.py)


def add_commands(sub) -> None:
    p = sub.add_parser("run", help="run the whole graph (prompts → … → benchmark report) through Dagster")
    from eagle3_platform.config import DEFAULT_PRESET, PRESET_NAMES

    p.add_argument("--preset", default=DEFAULT_PRESET, choices=PRESET_NAMES)
    p.add_argument("--target", default=None, help="smollm2-135m-instruct | tiny-random | PATH")
    p.add_argument("--workloads", default=None, help="comma-separated partitions (default: all)")
    p.add_argument("--through", default="benchmark_report", help="last asset to materialize (default: %(default)s)")
    p.add_argument("--env", default=None, choices=["local", "gcp"], help="default: $EAGLE3_ENV or local")
    p.add_argument("--data-dir", default=None, help="local storage root (default ./data)")
    p.add_argument("--dagster-home", default=None, help="default: $DAGSTER_HOME or ./.dagster_home")
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32: overrides every stage's preset dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads of every stage (0 = every core)")
    p.add_argument("--regen-budget-min", type=float, default=None,
                   help="regeneration wall minutes per partition (default: the preset's, cpu: 14; 0 = no "
                        "limit); a new value continues the published responses: a larger one asks "
                        "what the smaller one deferred or cut short")
    p.add_argument("--prompts-per-workload", type=int, default=None,
                   help="train prompts per workload (default: the preset's, cpu: 400, long_context "
                        "keeping its share, 64); a larger set keeps the answers already made and "
                        "regenerates only the new prompts")
    p.add_argument("--force", action="store_true", help="rebuild what is neither missing nor stale")
    p.add_argument("--keep-serving", action="store_true",
                   help="the deployment keeps serving after the run (redeployed when it is not up); "
                        "`eagle3 stop` stops it")
    p.set_defaults(func=run)


def checked(a) -> dict:
    """The flags as the launcher reads them (workloads as a list), or ValueError."""
    from eagle3_platform.store.records import WORKLOADS

    flags = {k: v for k, v in vars(a).items() if k not in ("func", "command")}
    flags["workloads"] = [w for w in (a.workloads or ",".join(WORKLOADS)).split(",") if w]
    bad = sorted(set(flags["workloads"]) - set(WORKLOADS))
    if bad:
        raise ValueError(f"unknown workloads {bad}; expected some of {list(WORKLOADS)}")
    if a.regen_budget_min is not None and not a.regen_budget_min >= 0:  # NaN too
        raise ValueError(f"--regen-budget-min {a.regen_budget_min}: minutes must be >= 0 (0 = no limit)")
    if a.prompts_per_workload is not None and a.prompts_per_workload < 1:
        raise ValueError(f"--prompts-per-workload {a.prompts_per_workload}: must be >= 1")
    output_dir(a.data_dir, "--data-dir")
    output_dir(a.dagster_home, "--dagster-home")
    return flags


def launch_command(a) -> list[str]:
    return [sys.executable, "-m", LAUNCHER, json.dumps(checked(a))]


def run(a) -> dict:
    cmd = launch_command(a)
    if not (PROJECT_ROOT / "assets" / "launch.py").exists():
        raise FileNotFoundError(f"assets/launch.py not found beside the package at {PROJECT_ROOT}; "
                                "`eagle3 run` needs the project checkout (definitions + assets)")
    env = {**CHILD_ENV, **os.environ, **({KEEP_SERVING_ENV: "1"} if a.keep_serving else {})}
    rc, summary = run_with_summary(cmd, cwd=PROJECT_ROOT, echo=_forward, env=env)
    if not summary["ok"]:
        raise ValueError(f"run failed (exit {rc}): {summary['error']}")
    summary.pop("ok", None)
    return summary


def _forward(line: str) -> None:
    """Progress goes to stderr (inherited); stdout lines are forwarded, except the launcher's summary
    (the caller prints its own)."""
    if not line.lstrip().startswith("{"):
        print(line, end="", flush=True)
