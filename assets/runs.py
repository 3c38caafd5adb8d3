"""Runs whose process is gone: `eagle3 run` executes its runs in its own launcher process, where no
Dagster daemon watches them, so a launcher killed outright (SIGKILL, a lost machine) would leave its
run STARTED for good. Each run is tagged with the launcher's process identity (pid and start time);
the next `eagle3 run` marks the runs of a launcher that no longer runs as failed, naming why."""
from __future__ import annotations

import os

from dagster import DagsterRunStatus, RunsFilter

from eagle3_platform.serve.launch import process_identity

LAUNCHER_TAG = "eagle3/launcher"  # "<pid>:<start ticks>" of the process executing the run
UNFINISHED = [DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


def launcher_tag() -> dict:
    ident = process_identity(os.getpid())
    return {LAUNCHER_TAG: f"{os.getpid()}:{ident[1] if ident else 0}"}


def fail_abandoned_runs(instance) -> list[str]:
    """Mark the unfinished runs whose launcher process is gone as failed -> their run ids."""
    failed = []
    for run in instance.get_runs(filters=RunsFilter(statuses=UNFINISHED)):
        tag = run.tags.get(LAUNCHER_TAG)
        if not tag or _alive(tag):
            continue
        instance.report_run_failed(run, f"its process ({tag.split(':')[0]}) is gone: the launcher was killed "
                                        "before the run ended; rerun the same command to go on")
        failed.append(run.run_id)
    return failed


def _alive(tag: str) -> bool:
    pid, _, ticks = tag.partition(":")
    ident = process_identity(int(pid)) if pid.isdigit() else None
    return ident is not None and str(ident[1]) == ticks
