"""The export against SGLang's own LlamaForCausalLMEagle3 (sglang/srt/models/llama_eagle3.py), from the
CPU venv scripts/sglang_cpu_venv.sh builds (sglang --no-deps over the project's torch/transformers).

- the source check: every config key that model code reads is in the export (or a LlamaConfig
  default), with the values it needs (SiLU: SGLang's LlamaMLP refuses anything else), and every
  exported tensor lands on a module the code builds;
- the load: import the model class, build it from the export's config on the CPU, load the exported
  weights through its own load_weights and compare them. Where the model code cannot be imported
  (PyPI's torchvision, which sglang's config package imports, is a CUDA build that cannot load under
  the CPU torch) the load stands in for it and for vllm, which loading never calls.
Both skip, saying how to build it, where the venv is absent.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("EAGLE3_SGLANG_CPU_ENV", ROOT / ".cache" / "venv-sglang-cpu"))
PYTHON = VENV / "bin" / "python"


def _models_dir() -> Path:
    if not PYTHON.exists():
        pytest.skip(f"no SGLang CPU venv at {VENV}: build it with `bash scripts/sglang_cpu_venv.sh`")
    found = sorted(VENV.glob("lib/python3*/site-packages/sglang/srt/models"))
    if not found:
        pytest.skip(f"{VENV} holds no sglang package: rerun `bash scripts/sglang_cpu_venv.sh`")
    return found[0]


def _config_reads(tree: ast.AST) -> set[str]:
    """Attributes read off a name `config` (config.X) anywhere in the module."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "config"}


def _assigned(tree: ast.AST, cls: str) -> set[str]:
    """self.X assigned in class cls's __init__."""
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _legacy_names(tree: ast.AST) -> dict[str, str]:
    """The literal dict load_weights renames checkpoint names with (absent in older versions)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "legacy_name_map" for t in n.targets):
            return ast.literal_eval(n.value)
    return {}


def test_export_config_and_names_match_sglangs_eagle3_source(random_head_export):
    from safetensors import safe_open
    from transformers import LlamaConfig

    models = _models_dir()
    eagle = ast.parse((models / "llama_eagle3.py").read_text())
    llama_src = (models / "llama.py").read_text()
    config = json.loads((random_head_export / "config.json").read_text())
    defaults = set(LlamaConfig().to_dict()) | set(dir(LlamaConfig()))
    # llama4_text's key is read only for that model_type; the export says llama
    missing = sorted(k for k in _config_reads(eagle) - {"intermediate_size_mlp"}
                     if k not in config and k not in defaults)
    assert not missing, f"SGLang's Eagle3 code reads {missing}, absent from the export"
    assert 'if hidden_act != "silu"' in llama_src and config["hidden_act"] == "silu"
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # else SGLang ties lm_head to the target's embedding
    assert config["target_hidden_size"] == config["hidden_size"] and config["draft_vocab_size"] < config["vocab_size"]
    top = _assigned(eagle, "LlamaModel") | _assigned(eagle, "LlamaForCausalLMEagle3")
    layer = _assigned(eagle, "LlamaDecoderLayer") | {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp"}
    assert {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp"} <= _assigned(
        ast.parse(llama_src), "LlamaDecoderLayer")
    # the head has no norm over the features before fc, per feature or whole (SGLang's optional ones)
    assert not any(config.get(k) or config["eagle_config"].get(k) for k in ("norm_before_fc", "fc_norm", "use_aux_norm"))
    assert len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3  # fc reads 3 x target_hidden_size
    renames = _legacy_names(eagle)  # e.g. midlayer -> layers.0 (load_weights renames these)
    with safe_open(str(random_head_export / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    for name in names:
        if name in ("d2t", "t2d"):  # load_weights reads d2t as the hot-token map, skips t2d
            continue
        for old, new in renames.items():
            name = name.replace(old, new) if old in name else name
        parts = name.split(".")
        assert parts[0] in top, f"{name}: SGLang builds no module {parts[0]!r}"
        if parts[0] in ("midlayer", "layers"):
            sub = parts[2] if parts[0] == "layers" else parts[1]
            assert sub in layer, f"{name}: SGLang's decoder layer has no {sub!r}"


LOAD = r'''
import importlib.machinery, importlib.util, json, sys, types, torch
from pathlib import Path
import transformers.utils.import_utils  # noqa: F401  (records torchvision as absent before the stand-in)
export = Path(sys.argv[1])


class _Absent(types.ModuleType):
    """Stands in for torchvision (PyPI's is a CUDA build the CPU torch cannot load), imported by
    sglang's config package for vision models, and vllm, whose rotary kernel sglang's RoPE imports
    on a plain CPU: an attribute is another stand-in. Loading weights calls neither."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return sys.modules.setdefault(f"{self.__name__}.{name}", _Absent(f"{self.__name__}.{name}"))


class _AbsentFinder:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _Absent(spec.name)

    def exec_module(self, module):
        module.__path__ = []


STAND_INS = {m for m in ("torchvision", "vllm") if importlib.util.find_spec(m) is None}
sys.meta_path.insert(0, _AbsentFinder())
try:
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
except Exception as e:
    print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
from safetensors.torch import load_file
from transformers import LlamaConfig
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path=str(export), device="cpu"))  # as a scheduler does
init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                             distributed_init_method="tcp://127.0.0.1:" + sys.argv[2])
initialize_model_parallel()  # widths from the published server args (all 1)
from sglang.srt.runtime_context import get_parallel
get_parallel().override_permanently(tp_rank=0)  # one rank: what a launcher's rank bundle says
cfg = LlamaConfig.from_pretrained(export)
model = LlamaForCausalLMEagle3(cfg)
weights = load_file(str(export / "model.safetensors"))
model.load_weights(weights.items())
params = dict(model.named_parameters())
fc = params["model.fc.weight"]
ok = torch.equal(fc.to(weights["fc.weight"].dtype), weights["fc.weight"])
ok &= torch.equal(params["lm_head.weight"][: weights["lm_head.weight"].shape[0]].to(weights["lm_head.weight"].dtype),
                  weights["lm_head.weight"])
print(json.dumps({"ok": bool(ok), "hot": int(model.get_hot_token_id().numel()), "params": len(params)}))
'''


def test_sglang_llama_eagle3_loads_the_export_on_cpu(random_head_export, tmp_path):
    _models_dir()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    proc = subprocess.run([str(PYTHON), str(script), str(random_head_export), str(port)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"SGLang's llama_eagle3 does not import on this CPU venv: {out['skip']}")
    config = json.loads((random_head_export / "config.json").read_text())
    assert out["ok"] and out["hot"] == config["draft_vocab_size"]
