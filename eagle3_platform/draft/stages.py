"""The draft stages behind one seam (eagle3_platform.stage): vocab → train → export."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagle3_platform.stage import ComputeRequest, PresetRequest, StageRequest, optional_count
from eagle3_platform.store.checks import output_dir, output_file


class VocabRequest(PresetRequest):
    stage = "vocab"
    features: list[str] = Field(min_length=1)  # feature dirs
    target: str  # prepared target: its vocab size, and the identity every shard must carry
    out: str  # .safetensors (+ .json stats beside it)
    draft_vocab_size: int | None = optional_count()  # None: the preset's (capped at the target's)


class TrainRequest(ComputeRequest):
    stage = "train"
    target: str
    features: list[str] = Field(min_length=1)
    out: str  # draft dir: checkpoints + draft.safetensors
    eval_features: list[str] = []  # held-out feature dirs
    vocab: str | None = None  # None: built from the features
    resume: bool = False  # continue from the checkpoint in out
    init_from: str | None = None  # a trained draft dir to start from (warm_start) instead of a fresh init
    max_steps: int | None = optional_count()
    epochs: int | None = optional_count()
    seed: int | None = None
    ckpt_every: int | None = optional_count()
    supervise: Literal["response", "all"] | None = None  # None: the preset's (train.TrainConfig.supervise)
    feature_noise: float | None = Field(default=None, ge=0.0, lt=1.0)  # None: the preset's


class ExportRequest(StageRequest):
    stage = "export"
    draft: str  # draft dir written by train
    out: str  # export dir: config.json + model.safetensors (SGLang LlamaForCausalLMEagle3)
    weights_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


def distinct_dirs(dirs: list[str]) -> list[str]:
    from eagle3_platform.features.shards import check_distinct

    return check_distinct(dirs)


def run_vocab(req: VocabRequest) -> dict:
    from eagle3_platform.draft.model import target_hf_config
    from eagle3_platform.draft.vocab import save_vocab, vocab_from_features
    from eagle3_platform.model.target import identity

    output_file(req.out)
    V = target_hf_config(req.target)["vocab_size"]
    vd = min(req.draft_vocab_size or req.platform().train.draft_vocab_size, V)
    d2t, t2d, stats = vocab_from_features(distinct_dirs(req.features), V, vd, identity(req.target))
    return save_vocab(req.out, d2t, t2d, stats)


def train_config(req: TrainRequest):
    from dataclasses import replace

    fields = {"max_steps": req.max_steps, "epochs": req.epochs, "seed": req.seed,
              "ckpt_every": req.ckpt_every, "dtype": req.dtype, "num_threads": req.torch_threads,
              "supervise": req.supervise, "feature_noise": req.feature_noise}
    return replace(req.platform().train, **{k: v for k, v in fields.items() if v is not None})


def run_train(req: TrainRequest) -> dict:
    from eagle3_platform.draft.train import train

    output_dir(req.out)
    return train(req.target, distinct_dirs(req.features), req.out, train_config(req), resume=req.resume,
                 eval_dirs=distinct_dirs(req.eval_features), vocab_path=req.vocab, init_from=req.init_from)


def run_export(req: ExportRequest) -> dict:
    from eagle3_platform.draft.export import export_draft

    output_dir(req.out)
    return export_draft(req.draft, req.out, dtype=req.weights_dtype)


RUNNERS = {VocabRequest: run_vocab, TrainRequest: run_train, ExportRequest: run_export}
