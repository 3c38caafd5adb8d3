"""The `compute` resource: where a heavy stage runs. Assets build the stage's request once
(eagle3_platform.stage) and hand it here.

- mode "in_process" (default): `eagle3_platform.stage.run(request)` in the run's process.
- mode "pipes": a child process through Dagster Pipes (`PipesSubprocessClient`): the request travels
  as JSON in the Pipes context's extras, `resources/pipes_worker.py` calls the same `run` and sends the
  summary back as a Pipes message. Swapping the client for dagster-k8s's `PipesK8sClient` runs the same
  worker on a GPU pod; the library never imports Dagster.
"""
from __future__ import annotations

import sys
from typing import Literal

from dagster import ConfigurableResource, PipesSubprocessClient

from eagle3_platform import stage
from resources.storage import PROJECT_ROOT


class ComputeResource(ConfigurableResource):
    mode: Literal["in_process", "pipes"] = "in_process"

    def run(self, context, request: stage.StageRequest) -> dict:
        """Run one stage here or in a Pipes worker; returns its summary."""
        context.log.info(f"{request.stage} ({self.mode}): {request!r}")  # repr hides the api key
        if self.mode == "in_process":
            return stage.run(request)
        done = PipesSubprocessClient(cwd=str(PROJECT_ROOT)).run(
            context=context, command=[sys.executable, "-m", "resources.pipes_worker"],
            extras=stage.to_payload(request))
        messages = done.get_custom_messages()
        if not messages:
            raise RuntimeError(f"{request.stage} reported no summary")
        return messages[-1]
