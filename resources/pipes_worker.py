"""Pipes worker: `python -m resources.pipes_worker`, started by the compute resource in "pipes" mode.

Reads the stage request from the Pipes context's extras, runs it with the same
`eagle3_platform.stage.run` the in-process mode calls, and reports the summary as a Pipes custom
message. The stage's progress lines (eagle3_platform.progress) travel as Pipes log messages, so they
land in the run's event log as the in-process mode's do. Uses only `dagster_pipes` (the tiny client
library), never `dagster` itself.
Under torchrun (a multi-GPU training) every rank runs this module: rank 0 talks to Dagster, the
others only read the request from the Pipes context and run their share. torchrun starts each rank
in a session of its own, so a rank asks the kernel to kill it when torchrun dies (a killed run must not
leave ranks that go on writing the checkpoint a resumed run reads).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys

from dagster_pipes import PipesDefaultContextLoader, PipesEnvVarParamsLoader, open_dagster_pipes
from pydantic import ValidationError

from eagle3_platform import progress, stage


class PipesForward(logging.Handler):
    """A progress record -> one Pipes log message (info) on the worker's Pipes logger."""

    def __init__(self, pipes_log):
        super().__init__()
        self.pipes_log = pipes_log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.pipes_log.info(record.getMessage())
        except Exception:  # a closed channel must not fail the stage
            self.handleError(record)


def follower() -> int:
    """A torchrun rank other than 0: the request from the Pipes context, no message channel (one
    writer per run: rank 0 reports the summary every rank computed)."""
    with PipesDefaultContextLoader().load_context(PipesEnvVarParamsLoader().load_context_params()) as data:
        extras = data["extras"]
    try:
        stage.run(stage.from_payload(extras))
    except (ValueError, OSError) as e:
        print(f"{extras.get('stage')} failed on rank {os.environ['RANK']}: {e}", file=sys.stderr)
        return 2
    return 0


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (torchrun's agent) exits (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)


def main() -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank
        die_with_parent()
    if int(os.environ.get("RANK", "0")) > 0:
        return follower()
    with open_dagster_pipes() as pipes:
        name = pipes.extras.get("stage")
        forward = PipesForward(pipes.log)
        progress.logger.addHandler(forward)
        try:
            with progress.echo_off():  # forwarded as Pipes log messages: not also on stderr
                summary = stage.run(stage.from_payload(pipes.extras))
        except (ValueError, OSError) as e:  # the stage's refusal, one line (as `eagle3` reports it)
            msg = stage.describe(e) if isinstance(e, ValidationError) else str(e)
            pipes.log.error(f"{name} failed: {msg}")
            raise SystemExit(2) from None
        finally:
            progress.logger.removeHandler(forward)
        pipes.report_custom_message(json.loads(json.dumps(summary, default=str)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
