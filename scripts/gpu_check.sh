#!/usr/bin/env bash
# Device check on one GPU (<= 8 minutes): CUDA extraction, training, local regeneration and the
# embedded engine's lossless decoding on the tiny random target, each timed against the CPU
# (scripts/gpu_check.py). Uses the torch already on the machine (a CUDA build) and only this working
# tree: no package index, no model hub.
#   bash scripts/gpu_check.sh                  # on a GPU machine
#   bash scripts/gpu_check.sh --device cpu     # dry run of the same logic on the CPU
# PYTHON picks the interpreter (default: .venv/bin/python when present, else python3); the project's
# pure-Python dependencies must import there (the script says which do not).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LIMIT_S=${EAGLE3_GPU_CHECK_LIMIT_S:-480}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

missing=$("$PYTHON" - <<'PY'
import importlib.util
mods = ["torch", "transformers", "tokenizers", "safetensors", "pydantic", "numpy", "tqdm"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "[gpu-check] error: $PYTHON cannot import: $missing (install them there; torch must be its CUDA build)" >&2
  exit 3
fi
"$PYTHON" -c 'import torch; print(f"[gpu-check] {torch.__version__}, CUDA {torch.version.cuda}, visible: {torch.cuda.is_available()}")'
exec timeout "$LIMIT_S" "$PYTHON" scripts/gpu_check.py "$@"
