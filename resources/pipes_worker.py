"""Pipes worker: `python -m resources.pipes_worker`, started by the compute resource in "pipes" mode.

Reads the stage request from the Pipes context's extras, runs it with the same
`eagle3_platform.stage.run` the in-process mode calls, and reports the summary as a Pipes custom
message. The stage's progress lines (eagle3_platform.progress) travel as Pipes log messages, so they
land in the run's event log as the in-process mode's do. Uses only `dagster_pipes` (the tiny client
library), never `dagster` itself.
"""
from __future__ import annotations

import json
import logging
import sys

from dagster_pipes import open_dagster_pipes
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


def main() -> int:
    with open_dagster_pipes() as pipes:
        name = pipes.extras.get("stage")
        forward = PipesForward(pipes.log)
        progress.logger.addHandler(forward)
        try:
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
