"""Export a trained head as an SGLang `LlamaForCausalLMEagle3` checkpoint (also loadable by vLLM).

SGLang silently skips tensor names it does not know (a misnamed file "loads" with random weights),
so the exporter validates every name, shape and dtype against the config it writes, re-reads the
written file, and only then renames the directory into place. Anything unexpected → ValueError and
nothing at out_dir.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_platform.draft.answer_ngrams import AnswerNgrams
from eagle3_platform.draft.model import DraftConfig, Eagle3Draft, build_draft, read_draft_dir
from eagle3_platform.draft.vocab import check_vocab
from eagle3_platform.model.families import UnsupportedTarget

ARCH = "LlamaForCausalLMEagle3"
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
# The embedded engine's answer n-gram table (answer_ngrams.py), when train wrote one: in a folder of
# its own, because SGLang loads every *.safetensors at the top of a model dir as weights.
ANSWERS_FILE = "lookup/answer_ngrams.safetensors"


def expected_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype): exactly the tensors of docs/ARCHITECTURE.md §5 for this config."""
    H, I = config["hidden_size"], config["intermediate_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    V, Vd = config["vocab_size"], config["draft_vocab_size"]
    w = EXPORT_DTYPES[config["torch_dtype"]]
    mid = "midlayer."
    return {
        "fc.weight": ((H, 3 * H), w),
        mid + "input_layernorm.weight": ((H,), w),
        mid + "hidden_norm.weight": ((H,), w),
        mid + "post_attention_layernorm.weight": ((H,), w),
        "norm.weight": ((H,), w),
        mid + "self_attn.q_proj.weight": ((nh * hd, 2 * H), w),
        mid + "self_attn.k_proj.weight": ((nkv * hd, 2 * H), w),
        mid + "self_attn.v_proj.weight": ((nkv * hd, 2 * H), w),
        mid + "self_attn.o_proj.weight": ((H, nh * hd), w),
        mid + "mlp.gate_proj.weight": ((I, H), w),
        mid + "mlp.up_proj.weight": ((I, H), w),
        mid + "mlp.down_proj.weight": ((H, I), w),
        "lm_head.weight": ((Vd, H), w),
        "d2t": ((Vd,), torch.int64),
        "t2d": ((V,), torch.bool),
    }


def validate_tensors(tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Raise ValueError listing every missing/unexpected name and wrong shape/dtype."""
    want = expected_tensors(config)
    problems = [f"missing tensor {n}" for n in sorted(set(want) - set(tensors))]
    problems += [f"unexpected tensor {n} (SGLang would silently ignore it)"
                 for n in sorted(set(tensors) - set(want))]
    for n in sorted(set(want) & set(tensors)):
        shape, dtype = want[n]
        t = tensors[n]
        if tuple(t.shape) != shape:
            problems.append(f"{n}: shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype:
            problems.append(f"{n}: dtype {t.dtype}, expected {dtype}")
    if not problems:
        try:
            check_vocab(tensors["d2t"], tensors["t2d"])
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("refusing to export: " + "; ".join(problems))


def sglang_config(cfg: DraftConfig, dtype: str, provenance: dict | None = None) -> dict:
    """The config SGLang's LlamaForCausalLMEagle3 reads: the head's own geometry (one Llama layer,
    SiLU, full rotary), the target's hidden size (fc's input is 3 x target_hidden_size), the captured
    layers and the draft vocabulary."""
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",  # the head's MLP (model.py), whatever the target's; SGLang accepts only SiLU
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": sglang_rope_scaling(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        # SGLang ties lm_head to embed_tokens when this is true: must be false for a draft-vocab head
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                         "use_aux_hidden_state": True},
        "eagle3_platform": provenance or {},
    }


# The rope types whose SGLang rotary (get_rope) computes what the head's (transformers') computes from
# the same dict; tests/test_sglang_eagle3_load.py checks each against SGLang's on the CPU.
SGLANG_ROPE_TYPES = ("linear", "llama3", "yarn")


def sglang_rope_scaling(cfg: DraftConfig) -> dict | None:
    """The head's rope_scaling as the export writes it: every value SGLang would default differently
    spelt out, or UnsupportedTarget where SGLang's rotary cannot compute the head's (dynamic NTK grows
    with the sequence in transformers, fixed in SGLang; longrope; keys only one side reads)."""
    if cfg.rope_scaling is None:
        return None
    rs = dict(cfg.rope_scaling)
    kind = rs.pop("type", None) or rs.get("rope_type")
    rs["rope_type"] = kind
    if kind not in SGLANG_ROPE_TYPES:
        raise UnsupportedTarget(f"rope_type {kind!r}: SGLang's rotary is not checked to compute the head's "
                                f"(exported exactly: default, {', '.join(SGLANG_ROPE_TYPES)})")
    if rs.get("factor") is None and kind != "yarn":
        raise UnsupportedTarget(f"rope_type {kind!r} without a factor: transformers refuses it")
    return _yarn_for_sglang(rs, cfg.max_position_embeddings) if kind == "yarn" else rs


def _yarn_for_sglang(rs: dict, max_positions: int) -> dict:
    """YaRN as transformers' _compute_yarn_parameters reads it, in the keys SGLang's
    YaRNScalingRotaryEmbedding reads: factor (transformers: max positions / original when absent),
    beta_fast/beta_slow (32/1 when absent or 0), truncate (true when absent). The cos/sin scale is
    0.1·ln(factor)+1 on both sides (mscale/mscale_all_dim: their ratio, both sides); an explicit
    attention_factor, which SGLang does not read, must equal it."""
    import math

    orig = rs.get("original_max_position_embeddings")
    if orig is None:
        raise UnsupportedTarget("yarn rope_scaling without original_max_position_embeddings")
    factor = float(rs.get("factor") or max_positions / orig)
    foreign = {k: rs[k] for k in ("extrapolation_factor", "attn_factor") if rs.get(k, 1) != 1}
    if foreign:
        raise UnsupportedTarget(f"yarn {foreign}: read by SGLang only, not by the head's rotary")
    ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
    both = ms is not None and ms_all is not None   # SGLang takes their ratio then; transformers if both non-zero
    if both and not (ms and ms_all):
        raise UnsupportedTarget(f"yarn mscale={ms} mscale_all_dim={ms_all}: SGLang and transformers "
                                "derive different cos/sin scales from these")

    def m(scale, k=1.0):
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
    scale = m(factor, ms) / m(factor, ms_all) if both else m(factor)
    if rs.get("attention_factor") is not None and abs(rs["attention_factor"] - scale) > 1e-6 * scale:
        raise UnsupportedTarget(f"yarn attention_factor {rs['attention_factor']}: SGLang scales cos/sin by "
                                f"{scale:.6g} (it does not read attention_factor)")
    return {**rs, "factor": factor, "beta_fast": rs.get("beta_fast") or 32, "beta_slow": rs.get("beta_slow") or 1,
            "truncate": bool(rs.get("truncate", True))}


def config_from_export(c: dict) -> DraftConfig:
    if c.get("architectures") != [ARCH] or c.get("num_hidden_layers") != 1:
        raise ValueError(f"not a single-layer {ARCH} export (architectures={c.get('architectures')})")
    hf = {**c, "rope_parameters": None}
    return DraftConfig.from_target(hf, c["draft_vocab_size"],
                                   c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def _refuse_unusable(draft_dir: Path, sd: dict[str, torch.Tensor]) -> None:
    """An untrained (0-step) or diverged (NaN/inf) head exports "fine" and serves garbage."""
    from eagle3_platform.draft.train import METRICS

    metrics = draft_dir / METRICS  # written by train; absent for heads built elsewhere (tests, tools)
    if metrics.exists() and json.loads(metrics.read_text()).get("steps") == 0:
        raise ValueError(f"refusing to export {draft_dir}: its head was trained for 0 steps "
                         f"({metrics}); train it on non-empty features first")
    bad = sorted(n for n, t in sd.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if bad:
        raise ValueError(f"refusing to export {draft_dir}: non-finite weights in {', '.join(bad)} "
                         "(training diverged?)")


def export_draft(draft_dir, out_dir, dtype: str = "bfloat16") -> dict:
    """draft_dir (train output) → out_dir with config.json + model.safetensors (SGLang Eagle3 format)."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r} not in {sorted(EXPORT_DTYPES)}")
    meta, sd = read_draft_dir(draft_dir)
    cfg = DraftConfig.from_dict(meta["draft"])
    _refuse_unusable(draft_dir, sd)
    tensors = {n: (t if t.dtype in (torch.int64, torch.bool) else t.to(EXPORT_DTYPES[dtype])).contiguous()
               for n, t in sd.items()}
    config = sglang_config(cfg, dtype, {"target": meta.get("target"), "source": str(draft_dir)})
    validate_tensors(tensors, config)                   # refuse before touching the disk
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        validate_tensors(load_file(str(tmp / WEIGHTS_FILE)), config)   # what is on disk
        answers = _copy_answers(draft_dir, tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return {"export_dir": str(out_dir), "dtype": dtype, "tensors": len(tensors),
            "bytes": (out_dir / WEIGHTS_FILE).stat().st_size, "draft_vocab_size": cfg.draft_vocab_size,
            "aux_layer_ids": list(cfg.aux_layer_ids), "answer_ngrams": answers}


def _copy_answers(draft_dir: Path, out_dir: Path) -> int | None:
    """draft_dir's answer n-gram table (train's) -> out_dir/ANSWERS_FILE, read back; -> its contexts, or
    None for a draft dir without one (heads trained before it existed: the lookup branch runs without)."""
    from eagle3_platform.draft.train import ANSWERS

    if not (draft_dir / ANSWERS).exists():
        return None
    (out_dir / ANSWERS_FILE).parent.mkdir()
    shutil.copyfile(draft_dir / ANSWERS, out_dir / ANSWERS_FILE)
    return len(AnswerNgrams.load(out_dir / ANSWERS_FILE))


def load_answer_ngrams(export_dir) -> AnswerNgrams | None:
    """The export's answer n-gram table, None where it has none."""
    path = Path(export_dir) / ANSWERS_FILE
    return AnswerNgrams.load(path) if path.exists() else None


def load_export(export_dir, target_or_dir) -> Eagle3Draft:
    """An exported head as an fp32 Eagle3Draft with the target's embedding (a prepared target dir or a
    loaded Target / HF model). Validates the export exactly like the exporter does."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_FILE).read_text())
    if config.get("torch_dtype") not in EXPORT_DTYPES:
        raise ValueError(f"{export_dir}: unsupported torch_dtype {config.get('torch_dtype')!r}")
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    validate_tensors(tensors, config)
    cfg = config_from_export(config)
    sd = {n: (t if t.dtype in (torch.int64, torch.bool) else t.float()) for n, t in tensors.items()}
    if isinstance(target_or_dir, (str, Path)):
        draft = build_draft(target_or_dir, cfg, init_from_target=False)
    else:
        model = getattr(target_or_dir, "model", target_or_dir)
        draft = Eagle3Draft(cfg)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight.float())
    draft.load_head_state_dict(sd)
    return draft.eval()
