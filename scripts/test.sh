#!/usr/bin/env bash
# The README's test command: every tier (unit, integration, e2e on the real SmolLM2 target).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not e2e"` for the fast tiers only.
set -euo pipefail
cd "$(dirname "$0")/.."
export TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS="" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DAGSTER_DISABLE_TELEMETRY=1
exec .venv/bin/python -m pytest -q "$@"
