"""The project-local Dagster instance: DAGSTER_HOME under the project (or wherever DAGSTER_HOME
already points), with telemetry disabled in its dagster.yaml."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from resources.storage import PROJECT_ROOT

TEMPLATE = Path(__file__).with_name("dagster.yaml")


def ensure_dagster_home(path: str | Path | None = None) -> Path:
    """Create DAGSTER_HOME (default $DAGSTER_HOME or <project>/.dagster_home) with our dagster.yaml,
    export it, and return it."""
    home = Path(path or os.environ.get("DAGSTER_HOME") or PROJECT_ROOT / ".dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copyfile(TEMPLATE, home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
    return home


def project_instance(path: str | Path | None = None):
    from dagster import DagsterInstance

    ensure_dagster_home(path)
    return DagsterInstance.get()
