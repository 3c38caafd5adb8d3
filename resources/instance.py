"""The project-local Dagster instance: DAGSTER_HOME under the project (or wherever DAGSTER_HOME
already points), with telemetry disabled in its dagster.yaml; and the code location its runs belong to."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from resources.storage import PROJECT_ROOT

TEMPLATE = Path(__file__).with_name("dagster.yaml")
WORKSPACE = PROJECT_ROOT / "workspace.yaml"


def ensure_dagster_home(path: str | Path | None = None) -> Path:
    """Create DAGSTER_HOME (default $DAGSTER_HOME or <project>/.dagster_home) with our dagster.yaml,
    export it, and return it."""
    home = Path(path or os.environ.get("DAGSTER_HOME") or PROJECT_ROOT / ".dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copyfile(TEMPLATE, home / "dagster.yaml")
    else:
        _add_missing_settings(home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
    return home


def _add_missing_settings(path: Path) -> None:
    """A home made by an older template gains the template's top-level settings it lacks (progress
    logging, run monitoring); what the file sets already is never changed."""
    import yaml

    current = yaml.safe_load(path.read_text()) or {}
    missing = {k: v for k, v in (yaml.safe_load(TEMPLATE.read_text()) or {}).items() if k not in current}
    if isinstance(current, dict) and missing:
        with open(path, "a") as f:
            f.write("\n" + yaml.safe_dump(missing, sort_keys=True))


def project_instance(path: str | Path | None = None):
    from dagster import DagsterInstance

    ensure_dagster_home(path)
    return DagsterInstance.get()


def job_origin(job_name: str):
    """Where a job lives in the workspace the UI loads (workspace.yaml's code location): a run created
    with it shows on the UI's timeline and re-executes from the UI like a run launched there."""
    from dagster._core.definitions.repository_definition.valid_definitions import SINGLETON_REPOSITORY_NAME
    from dagster._core.remote_origin import RemoteRepositoryOrigin
    from dagster._core.workspace.load import location_origins_from_yaml_paths

    (location,) = location_origins_from_yaml_paths([str(WORKSPACE)])
    return RemoteRepositoryOrigin(location, SINGLETON_REPOSITORY_NAME).get_job_origin(job_name)
