"""The one place that assembles the Dagster `Definitions` (loaded by workspace.yaml).

Environment selection (local disk vs GCS, preset, target) happens in `resources.build_resources`
from EAGLE3_ENV / EAGLE3_PRESET / EAGLE3_TARGET; each asset's code version is derived from its code and
the settings those resources resolve to (assets/versions.py), so the UI shows what is stale."""
from __future__ import annotations

import os

# Before the assets import the model stack: presidio and the HF hub never reach the network.
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dagster import Definitions

from assets import ALL_ASSETS, ALL_CHECKS, ALL_JOBS, ALL_SENSORS
from assets.versions import with_code_versions
from resources import build_resources


def build_definitions(**resource_overrides) -> Definitions:
    resources = build_resources(**resource_overrides)
    assets = with_code_versions(ALL_ASSETS, resources["preset"], resources["target"])
    return Definitions(assets=assets, asset_checks=ALL_CHECKS, jobs=ALL_JOBS, sensors=ALL_SENSORS,
                       resources=resources)


defs = build_definitions()
