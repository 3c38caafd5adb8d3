"""The export against SGLang's own LlamaForCausalLMEagle3 (sglang/srt/models/llama_eagle3.py), from the
CPU venv scripts/sglang_cpu_venv.sh builds (sglang --no-deps over the project's torch/transformers).

- the source check: every config key that model code reads is in the export (or a LlamaConfig
  default), with the values it needs (SiLU: SGLang's LlamaMLP refuses anything else), and every
  exported tensor lands on a module the code builds;
- the load, for a head on every zoo family's tiny target and on the ropes real checkpoints carry
  (Llama-3.1 llama3, GPT-OSS and Qwen3 YaRN, Gemma-3 linear), all in one process: import the model
  class, build it from the export's config on the CPU, load the exported weights through its own
  load_weights; the config values it reads are the head's, every parameter it builds equals an
  exported tensor, and its rotary (get_rope from the exported config) turns q/k as the head's does.
  Where the model code cannot be imported (PyPI's torchvision, which sglang's config package imports,
  is a CUDA build that cannot load under the CPU torch) the load stands in for it and for vllm, which
  loading never calls.
Both skip, saying how to build it, where the venv is absent.
"""
from __future__ import annotations

import ast
import dataclasses
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
    _source_check(random_head_export)


def _source_check(random_head_export):
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


# ---- every family's export through SGLang's own loader and rotary, one process ----------------------
def _variants(base: dict) -> dict[str, tuple[str, dict]]:
    """name -> (zoo family whose checkpoint gives the embedding, target text config): every zoo family
    as the zoo builds it, and the ropes real checkpoints carry."""
    big = dict(max_position_embeddings=131072)
    return {
        **{f: (f, c) for f, c in base.items()},
        # Llama-3.1: llama3 frequency bands
        "llama-rope-llama3": ("llama", {**base["llama"], **big, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
        # GPT-OSS-20b/120b: YaRN x32 over 4096 positions, untruncated correction range
        "gpt_oss-rope-131k": ("gpt_oss", {**base["gpt_oss"], **big}),
        # Qwen3 long context: YaRN x4 over 32768, truncated (the default); head_dim != H / heads
        "qwen3-rope-yarn": ("qwen3", {**base["qwen3"], **big, "head_dim": 32, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
            "original_max_position_embeddings": 32768}}),
        # Gemma-3 >= 4B: linear x8 on the full-attention layers (the head's), none on the sliding ones
        "gemma3-rope-linear": ("gemma3_text", {**base["gemma3_text"], **big, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    }


@pytest.fixture(scope="module")
def family_exports(tmp_path_factory):
    """name -> (export dir, the head's DraftConfig, rotary inputs file): a head for each zoo family's
    tiny target (and rope variant) as train builds it (the target's geometry, embedding and lm_head
    rows, a draft vocabulary of 32 scattered ids), every weight perturbed so that none is a default,
    exported in bf16; positions reach each config's last one."""
    import torch
    from safetensors.torch import save_file

    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
    from eagle3_platform.draft.train import save_draft_dir
    from eagle3_platform.model.families import capture_layer_ids
    from eagle3_platform.testing.zoo import ZOO, build_zoo_model

    root = tmp_path_factory.mktemp("family_exports")
    dirs = {f: build_zoo_model(f, root / "zoo" / f) for f in sorted(ZOO)}
    out = {}
    for name, (fam, c) in _variants({f: target_hf_config(d) for f, d in dirs.items()}).items():
        torch.manual_seed(len(out))
        cfg = DraftConfig.from_target(c, 32, capture_layer_ids(c["num_hidden_layers"]))
        ids = torch.randperm(cfg.vocab_size)[:32].sort().values
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        draft = build_draft(dirs[fam], cfg, d2t=ids - torch.arange(32), t2d=t2d)
        with torch.no_grad():
            for n, p in draft.named_parameters():
                if not n.startswith("embed_tokens"):
                    p.add_(0.1 * torch.randn_like(p))
        save_draft_dir(root / name / "draft", draft)
        export_draft(root / name / "draft", root / name / "export")
        last = cfg.max_position_embeddings - 1
        pos = torch.tensor([0, 1, 2, 7, 16, 100, 1000, 2047, 4095, 4096, 8191, 8192, 32767, 65536, last])
        pos = pos[pos <= last].unique()
        save_file({"positions": pos, "q": torch.randn(len(pos), cfg.num_attention_heads * cfg.head_dim),
                   "k": torch.randn(len(pos), cfg.num_key_value_heads * cfg.head_dim)}, str(root / name / "rope.safetensors"))
        out[name] = (root / name / "export", cfg, root / name / "rope.safetensors", c["num_hidden_layers"])
    return out


LOAD = r'''
import importlib.machinery, importlib.util, json, sys, time, types, torch
from pathlib import Path
import transformers.utils.import_utils  # noqa: F401  (records torchvision as absent before the stand-in)
cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[3])


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


t0 = time.perf_counter()
STAND_INS = {m for m in ("torchvision", "vllm") if importlib.util.find_spec(m) is None}
sys.meta_path.insert(0, _AbsentFinder())
try:
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
except Exception as e:
    print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path=cases[0]["export"], device="cpu"))  # as a scheduler does
init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                             distributed_init_method="tcp://127.0.0.1:" + sys.argv[2])
initialize_model_parallel()  # widths from the published server args (all 1)
from sglang.srt.runtime_context import get_parallel
get_parallel().override_permanently(tp_rank=0)  # one rank: what a launcher's rank bundle says
seen, t1 = {}, time.perf_counter()
for case in cases:
    export = Path(case["export"])
    cfg = LlamaConfig.from_pretrained(export)
    model = LlamaForCausalLMEagle3(cfg)
    model.load_weights(load_file(str(export / "model.safetensors")).items())
    attn = next(m for m in model.modules() if hasattr(m, "rotary_emb"))
    rot, rope = attn.rotary_emb, load_file(case["rope"])
    q, k = rot.forward_native(rope["positions"], rope["q"].clone(), rope["k"].clone())
    tensors = {f"param/{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    save_file({**tensors, "hot": model.get_hot_token_id(), "q": q.contiguous(), "k": k.contiguous()},
              str(out / (case["name"] + ".safetensors")))
    seen[case["name"]] = {
        "hidden_act": cfg.hidden_act, "target_hidden_size": model.model.hidden_size_in,
        "fc_in": model.model.fc.in_features, "aux_ids": cfg.eagle_config["eagle_aux_hidden_state_layer_ids"],
        "draft_vocab_size": cfg.draft_vocab_size, "head_dim": attn.head_dim, "rotary_dim": rot.rotary_dim,
        "rope_class": type(rot).__name__, "rope_base": float(rot.base), "rope_parameters": cfg.rope_parameters,
        "norm_before_fc": model.model.norm_before_fc, "fc_norm": model.model.fc_norm is not None}
print(json.dumps({"seen": seen, "import_s": t1 - t0, "load_s": time.perf_counter() - t1}))
'''


@pytest.fixture(scope="module")
def sglang_loaded(family_exports, tmp_path_factory):
    """What SGLang's LlamaForCausalLMEagle3 makes of every family export, in one process: the config
    values it reads (json) and, per export, its parameters after load_weights, its hot-token map and
    its rotary applied to the case's q/k (safetensors)."""
    import socket

    _models_dir()
    root = tmp_path_factory.mktemp("sglang_loaded")
    cases = [{"name": n, "export": str(e), "rope": str(r)} for n, (e, _, r, _) in family_exports.items()]
    (root / "cases.json").write_text(json.dumps(cases))
    (root / "load.py").write_text(LOAD)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([str(PYTHON), str(root / "load.py"), str(root / "cases.json"), str(port), str(root)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"SGLang's llama_eagle3 does not import on this CPU venv: {out['skip']}")
    return out, root


def _case_names():
    from eagle3_platform.testing.zoo import ZOO

    return list(_variants({f: {} for f in ZOO}))


@pytest.mark.parametrize("name", _case_names())
def test_family_export_config_and_names_match_sglangs_eagle3_source(name, family_exports):
    _source_check(family_exports[name][0])


@pytest.mark.parametrize("name", _case_names())
def test_sglang_reads_the_heads_config_and_loads_its_weights(name, family_exports, sglang_loaded):
    import torch
    from safetensors.torch import load_file

    from eagle3_platform.model.families import capture_layer_ids

    out, root = sglang_loaded
    export, cfg, _, layers = family_exports[name]
    seen = out["seen"][name]
    assert seen["hidden_act"] == "silu" == cfg.hidden_act
    assert seen["target_hidden_size"] == cfg.hidden_size and seen["fc_in"] == 3 * cfg.hidden_size
    assert seen["aux_ids"] == list(cfg.aux_layer_ids) == capture_layer_ids(layers)  # the target's layers [1, L/2-1, L-4]
    assert seen["draft_vocab_size"] == cfg.draft_vocab_size == 32
    assert seen["head_dim"] == seen["rotary_dim"] == cfg.head_dim  # full rotary on the head's head_dim
    assert not seen["norm_before_fc"] and not seen["fc_norm"]
    assert seen["rope_base"] == cfg.rope_theta
    got, want = load_file(str(root / f"{name}.safetensors")), load_file(str(export / "model.safetensors"))
    params = {n.removeprefix("param/"): t for n, t in got.items() if n.startswith("param/")}
    layer = "model.layers.0." if any(n.startswith("model.layers.0.") for n in params) else "model.midlayer."
    m = {n.removeprefix("midlayer."): t for n, t in want.items() if n.startswith("midlayer.")}
    expect = {"model.fc.weight": want["fc.weight"], "model.norm.weight": want["norm.weight"],
              layer + "self_attn.qkv_proj.weight": torch.cat([m[f"self_attn.{p}_proj.weight"] for p in "qkv"]),
              layer + "mlp.gate_up_proj.weight": torch.cat([m["mlp.gate_proj.weight"], m["mlp.up_proj.weight"]]),
              **{layer + n: m[n] for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                                           "hidden_norm.weight", "post_attention_layernorm.weight")}}
    # every parameter SGLang builds holds an exported tensor, bit for bit (the embedding is the target's)
    assert set(params) - set(expect) == {"lm_head.weight", "model.embed_tokens.weight"}
    for n, t in expect.items():
        assert torch.equal(params[n].to(t.dtype), t), n
    vd = want["lm_head.weight"].shape[0]
    assert torch.equal(params["lm_head.weight"][:vd].to(torch.bfloat16), want["lm_head.weight"])
    assert torch.equal(got["hot"], want["d2t"] + torch.arange(vd)) and bool(want["t2d"][got["hot"]].all())


@pytest.mark.parametrize("name", _case_names())
def test_sglang_rotary_equals_the_heads(name, family_exports, sglang_loaded):
    """SGLang's get_rope from the exported config, applied to q/k, equals the head's rotary (transformers'
    rope of the head's DraftConfig) on the same positions, fp32, up to each config's last position."""
    import torch
    from safetensors.torch import load_file

    from eagle3_platform.draft.model import Eagle3Draft, apply_rope

    out, root = sglang_loaded
    export, cfg, rope_file, _ = family_exports[name]
    rope, got = load_file(str(rope_file)), load_file(str(root / f"{name}.safetensors"))
    pos = rope["positions"]

    def head_rotary(c, x):                                   # x [T, h*hd] -> the head's rotary of it
        cos, sin = Eagle3Draft(c).rope(rope[x], pos[None])   # [1,T,hd]
        t = rope[x].view(len(pos), -1, c.head_dim).transpose(0, 1)[None]  # [1,h,T,hd]
        return apply_rope(t, cos, sin)[0].transpose(0, 1).reshape(len(pos), -1)

    for x in ("q", "k"):
        assert (got[x] - rope[x]).abs().max() > 0.1  # the rotary turned them
        # the same fp32 formulae on both sides: equal to rounding (measured: bit for bit)
        assert (head_rotary(cfg, x) - got[x]).abs().max() <= 1e-5, x
    kind = (cfg.rope_scaling or {}).get("rope_type", "default")
    if kind != "default":  # the check can fail: the same head without its scaling is far off
        plain = dataclasses.replace(cfg, rope_scaling=None)
        assert (head_rotary(plain, "q") - got["q"]).abs().max() > 0.1
    assert out["seen"][name]["rope_class"] == {"default": "RotaryEmbedding", "linear": "LinearScalingRotaryEmbedding",
                                               "llama3": "Llama3RotaryEmbedding",
                                               "yarn": "YaRNScalingRotaryEmbedding"}[kind]


def test_sglang_load_wall_time(sglang_loaded):
    """One process loads every family's export (the import is most of it)."""
    out, _ = sglang_loaded
    print(f"sglang import {out['import_s']:.1f} s, {len(out['seen'])} exports loaded in {out['load_s']:.1f} s")
    assert len(out["seen"]) == len(_case_names())
