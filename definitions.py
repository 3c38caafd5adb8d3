"""The one place that assembles the Dagster `Definitions` (loaded by workspace.yaml).

Environment selection (local disk vs GCS, preset, target) happens in `resources.build_resources`
from EAGLE3_ENV / EAGLE3_PRESET / EAGLE3_TARGET."""
from __future__ import annotations

import os

from dagster import Definitions

from assets import ALL_ASSETS, ALL_CHECKS, ALL_JOBS, ALL_SENSORS
from resources import build_resources

os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")  # presidio: never reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_definitions(**resource_overrides) -> Definitions:
    return Definitions(assets=ALL_ASSETS, asset_checks=ALL_CHECKS, jobs=ALL_JOBS, sensors=ALL_SENSORS,
                       resources=build_resources(**resource_overrides))


defs = build_definitions()
