#!/usr/bin/env bash
# A CPU venv holding SGLang's own code, for checking exports against its LlamaForCausalLMEagle3 (tests/
# test_sglang_eagle3_load.py): sglang installed with --no-deps plus the light modules its imports need,
# over the project's torch and transformers (a .pth file points at .venv's site-packages). It serves
# nothing: serving uses scripts/sglang_env.sh's GPU environment.
#   bash scripts/sglang_cpu_venv.sh       # build or update it (default .cache/venv-sglang-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=${EAGLE3_SGLANG_CPU_ENV:-.cache/venv-sglang-cpu}
SGLANG=$(grep -m1 '^sglang==' scripts/sglang-requirements.txt)
# what `import sglang` and its model code import beyond torch/transformers. Not torchvision: PyPI has
# only its CUDA build, which cannot load under the CPU torch, nor vllm (its rotary kernel is imported on
# a plain CPU): the test stands in for both, as loading weights calls neither.
LIGHT="orjson pybase64 msgspec ipython traitlets triton dill apache-tvm-ffi sentencepiece compressed-tensors
  loguru openai sniffio partial-json-parser"
[ -x "$ENV_DIR/bin/python" ] || .venv/bin/python -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" - <<'PY'
import pathlib, site, subprocess
main = subprocess.check_output([".venv/bin/python", "-c", "import site; print(site.getsitepackages()[0])"], text=True).strip()
pathlib.Path(site.getsitepackages()[0], "eagle3_main_venv.pth").write_text(main + "\n")
PY
echo "[sglang-cpu] installing $SGLANG (--no-deps) and $LIGHT into $ENV_DIR"
"$ENV_DIR/bin/python" -m pip install -q --no-deps "$SGLANG" $LIGHT
"$ENV_DIR/bin/python" -c "import sglang; print(f'[sglang-cpu] ok: sglang {sglang.__version__}')"
