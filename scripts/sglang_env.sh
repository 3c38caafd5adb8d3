#!/usr/bin/env bash
# The SGLang serving environment: a venv of its own (default .venv-sglang) with the pins of
# scripts/sglang-requirements.txt. SGLang pins torch/transformers/tokenizers other than the project's,
# so it never shares the project's venv; the `serving` resource launches SGLang with this
# environment's python (EAGLE3_SGLANG_PYTHON, default <project>/.venv-sglang/bin/python).
#   bash scripts/sglang_env.sh            # build or update it (Linux x86-64, glibc >= 2.34, a CUDA GPU)
#   bash scripts/sglang_env.sh --check    # resolve only (uv pip compile), install nothing
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=scripts/sglang-requirements.txt
ENV_DIR=${EAGLE3_SGLANG_ENV:-.venv-sglang}
UV=${UV:-$(command -v uv || echo .venv/bin/uv)}
[ -x "$UV" ] || { echo "[sglang-env] error: uv not found (bash scripts/setup.sh installs it in .venv)" >&2; exit 1; }

if [ "${1:-}" = "--check" ]; then
  exec "$UV" pip compile -q "$REQ" --python-version 3.11 --python-platform x86_64-manylinux_2_34 -o /dev/null
fi

[ -x "$ENV_DIR/bin/python" ] || "$UV" venv -q --python 3.11 "$ENV_DIR"
echo "[sglang-env] installing $(grep -m1 '^sglang' "$REQ") into $ENV_DIR"
"$UV" pip install -q --compile-bytecode --python "$ENV_DIR/bin/python" -r "$REQ"
"$ENV_DIR/bin/python" - <<'PY'
import sglang, torch
print(f"[sglang-env] ok: sglang {sglang.__version__}, torch {torch.__version__}, "
      f"CUDA {'visible' if torch.cuda.is_available() else 'NOT visible'}")
PY
echo "[sglang-env] export EAGLE3_SGLANG_PYTHON=$PWD/$ENV_DIR/bin/python EAGLE3_SERVING=sglang"
