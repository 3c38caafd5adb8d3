"""The `compute` resource: where a heavy step runs.

- mode "in_process" (default): the asset calls the library function directly.
- mode "pipes": the asset runs the same step as its `eagle3 <cmd>` CLI command in a child process
  through Dagster Pipes (`PipesSubprocessClient`); the child (`resources/pipes_worker.py`) streams
  the command's output and sends its JSON summary back as a Pipes message. Swapping the client for
  dagster-k8s's `PipesK8sClient` runs the same command on a GPU pod; the library never imports Dagster.
"""
from __future__ import annotations

import sys
from typing import Callable, Literal

from dagster import ConfigurableResource, PipesSubprocessClient

from resources.storage import PROJECT_ROOT


class ComputeResource(ConfigurableResource):
    mode: Literal["in_process", "pipes"] = "in_process"

    def run(self, context, fn: Callable[[], dict], cli_args: list[str]) -> dict:
        """Run one step: `fn()` in-process, or `eagle3 *cli_args` through Pipes. Returns its summary."""
        context.log.info(f"step: eagle3 {' '.join(cli_args)} ({self.mode})")
        if self.mode == "in_process":
            return fn() or {}
        command = [sys.executable, "-m", "resources.pipes_worker", *cli_args]
        done = PipesSubprocessClient(cwd=str(PROJECT_ROOT)).run(context=context, command=command)
        messages = done.get_custom_messages()
        if not messages:
            raise RuntimeError(f"eagle3 {cli_args[0]} reported no summary")
        return messages[-1]
