"""TTT training of the EAGLE-3 head from offline feature shards (docs/ARCHITECTURE.md §5).

Determinism (what makes `--resume` end with the same weights as an uninterrupted run):
- the data order is a pure function of (seed, epoch): batch `step` is plan[step], rebuilt on resume
  (batches hold samples of similar length, epoch_batches);
- the learning rate is a pure function of step (no scheduler object to restore);
- checkpoints hold the head weights, AdamW moments and step counts, and the torch RNG state, all as
  safetensors (+ JSON scalars) — no pickle; written to a tmp dir and renamed (atomic).
Device: `TrainConfig.device` ("auto" = CUDA where torch sees a GPU, else the CPU; a rank of a multi-GPU
torchrun takes cuda:LOCAL_RANK). Batches are collated on the CPU and moved; checkpoints and outputs are
written from CPU copies, so a run resumes on either device.
Multi-process: torchrun (env WORLD_SIZE/RANK) or an already-initialised process group → DDP (gloo on
CPU, NCCL on CUDA). Every rank takes samples rank::world of the same global batch; the loss is normalised by the
global count of supervised positions, so 2 processes compute the 1-process gradient of that batch.
    torchrun --standalone --nproc_per_node 2 --local-ranks-filter 0 -m eagle3_platform.cli train ...
(every rank returns the same summary; the filter keeps the console to one JSON line).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from eagle3_platform.draft.answer_ngrams import ANSWER_LEAD, AnswerNgrams
from eagle3_platform.draft.metrics import simulated_acceptance
from eagle3_platform.draft.model import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, Eagle3Draft, build_draft, \
    read_draft_dir, target_head_weights, target_hf_config
from eagle3_platform.draft.ttt import TargetTop1, TTTLoss, batch_targets, collate, real_positions, step_masks
from eagle3_platform.draft.vocab import load_vocab, save_vocab, vocab_from_features
from eagle3_platform.draft.warm_start import warm_start
from eagle3_platform.model.compute import autocast, resolve_device, resolve_dtype, set_threads
from eagle3_platform.progress import Ticker
from eagle3_platform.store.records import atomic_write, write_json_atomic

METRICS, VOCAB, ANSWERS = "metrics.json", "vocab.safetensors", "answer_ngrams.safetensors"
CKPT = "checkpoint"


@dataclass(frozen=True)
class TrainConfig:
    ttt_steps: int = 7                 # K
    draft_vocab_size: int = 32000      # Vd (capped at the target vocab size)
    lr: float = 1e-4
    warmup_ratio: float = 0.03         # fraction of total steps with linear warm-up
    min_lr_ratio: float = 0.0          # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    batch_tokens: int = 16384          # real (unpadded) tokens per global batch
    max_len: int = 2048                # samples are truncated to this many tokens
    epochs: int = 10
    max_steps: int | None = None       # cap on optimizer steps (None: all epochs)
    ckpt_every: int = 500
    log_every: int = 50
    eval_samples: int = 256            # training samples re-evaluated for train acc_k (first N)
    seed: int = 0
    # lm_head/norm from the target's rows: measured worse (initial CE 31 vs 15 on SmolLM2 demo features,
    # since fc(g) is not the target's final state), so off; kept as an option
    init_from_target: bool = False
    num_threads: int | None = None     # torch intra-op threads (None/0: every core)
    # compute dtype of the head's forward (bf16 autocast where it pays for dense work,
    # compute.resolve_dtype); master weights and AdamW state stay fp32, the loss is fp32 (ttt.step_terms)
    dtype: str = "auto"
    # which positions the loss supervises: "response" (the predicted token is a response token: what
    # the head drafts at inference) or "all" (prompt tokens too). The teacher is the target's own
    # distribution at every position, so prompt positions are valid extra examples of "what the target
    # predicts next from its features" at no extra regeneration or extraction cost (docs/ARCHITECTURE.md
    # §5). Held-out metrics always count response positions only. "all" lifts held-out tau a little
    # for ~1.4x the step cost, no more than the same time spent on more epochs over the responses, so
    # the presets keep "response".
    supervise: str = "response"
    # Uniform noise on the target features while training (EAGLE-1's augmentation): each layer's
    # feature vector gets U(-a, a)·rms per element, a = feature_noise, rms = that vector's RMS (the
    # three layers' scales differ ~10x). A data-starved head memorises its few samples; noise makes
    # every epoch see other features. Seeded per step, so a resumed run draws the same noise. 0 = off.
    feature_noise: float = 0.0
    device: str = "auto"               # "auto" = cuda when available, else cpu (train_device)
    # epochs of a pipeline run that starts from the published head (warm_start) because the data grew;
    # 0 = the pipeline always trains from scratch. Not part of a run's fingerprint: `epochs` is what
    # the run trains, and the pipeline passes this as `epochs` when it warm-starts.
    warm_start_epochs: int = 0

    def __post_init__(self):
        if self.supervise not in SUPERVISE:
            raise ValueError(f"supervise must be one of {', '.join(SUPERVISE)}, not {self.supervise!r}")
        if not 0.0 <= self.feature_noise < 1.0:
            raise ValueError(f"feature_noise must be in [0, 1), not {self.feature_noise}")


SUPERVISE = ("response", "all")
RUN_PLACEMENT = ("num_threads", "device")  # where a run computes, not what: a resume may change them
NOT_FINGERPRINTED = (*RUN_PLACEMENT, "warm_start_epochs")  # nor what a run trains (see warm_start_epochs)
# TrainConfig fields added after checkpoints were already being written, with the value those
# checkpoints trained with: a resume across the upgrade matches on it instead of refusing
LATER_SETTINGS = {"supervise": "response", "feature_noise": 0.0}

PRESETS: dict[str, TrainConfig] = {
    # unit tests: seconds on the tiny target; max_len 512 holds the tiny pipeline's conversations whole
    # (~250-450 tokens, the response last: at 128 its head saw no response position and never trained)
    "tiny": TrainConfig(ttt_steps=3, draft_vocab_size=64, lr=1e-3, warmup_ratio=0.2, batch_tokens=256,
                        max_len=512, epochs=2, ckpt_every=2, log_every=1, eval_samples=8,
                        dtype="float32", warm_start_epochs=1),
    # embedded default run on 2 CPU cores, a few thousand tokens, a few minutes: K=2 instead of 7 (steps
    # 3-7 add nothing at this data size: K 4 gives the same engine tau in twice the training time;
    # scripts/bench_scaling.py --overrides); lr 1e-3 because
    # a few dozen steps at the public 1e-4 barely move a fresh head (1e-4 assumes ~10^5 steps);
    # Vd 4096: a demo corpus has ~1k distinct response tokens (SmolLM2, 47 chat conversations: 1005),
    # and the Vd-wide lm_head is the largest part of the head's cost; small batches → more steps.
    "demo": TrainConfig(ttt_steps=2, draft_vocab_size=4096, lr=1e-3, warmup_ratio=0.05,
                        batch_tokens=1024, max_len=1024, epochs=3, ckpt_every=10, log_every=2,
                        eval_samples=64),
    # the best head 2 CPU cores train within the cpu preset's 2 hours (0.3-0.5M regenerated tokens)
    # K 2 x 4 epochs: on all the cpu data it beat K 4 x 2 epochs (tau 1.43 vs 1.37) in the same
    # training time; at this data size depths 1-2 trained well are worth more than depths 3-4.
    # 6 epochs, not 4: at ~250k response tokens engine tau +0.06 for ~15% more training time.
    # feature_noise 0.2: lifts held-out acceptance at ~100k tokens (every workload up), neutral at
    # ~250k; kept, as it helps where a run gathers less data (scripts/bench_scaling.py --overrides).
    # warm_start_epochs 1: the published head + 1 epoch over grown data matches 3 epochs from scratch
    # on it in a third of the steps.
    "cpu": TrainConfig(ttt_steps=2, draft_vocab_size=8192, lr=1e-3, warmup_ratio=0.03,
                       batch_tokens=4096, max_len=2048, epochs=6, ckpt_every=20, log_every=10,
                       eval_samples=128, feature_noise=0.2, warm_start_epochs=1),
    # real training (GPU / many cores): the public EAGLE-3 / SpecForge recipe
    "full": TrainConfig(ttt_steps=7, draft_vocab_size=32000, lr=1e-4, warmup_ratio=0.03,
                        batch_tokens=16384, max_len=4096, epochs=10, ckpt_every=500, log_every=50,
                        eval_samples=256),
}


# ---- device + distributed ------------------------------------------------------------------------
def train_device(setting: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> the device this process trains on: 'auto' is CUDA where
    torch sees a GPU, and a torchrun rank on CUDA takes cuda:LOCAL_RANK (one GPU per process)."""
    try:
        device = torch.device(resolve_device(setting))
    except RuntimeError:  # not a device string at all
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"train device {setting!r}: expected auto, cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"train device {setting!r}: torch sees no CUDA device here")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def dist_setup(device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """(rank, world). Initialises the process group from torchrun's env when needed: NCCL for CUDA
    ranks, gloo on CPU."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- data plan + schedule ------------------------------------------------------------------------
LENGTH_GROUP_BATCHES = 50  # samples are sorted by length within windows of about this many batches


def epoch_batches(lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """One epoch's batches: a seeded permutation, cut into windows of ~LENGTH_GROUP_BATCHES batches,
    each window sorted by length and packed greedily to batch_tokens, then the batches shuffled.
    Why sort: batches are padded to their longest sample, and a random mix of 150- and 1500-token
    samples pads ~2x the positions (2.7x the attention); sorted windows keep the mix random across
    steps while every batch holds similar lengths (the idea of HF's LengthGroupedSampler).
    A sample of length 0 (trainable_lengths: nothing to supervise) is left out."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    n_of = lambda i: min(lengths[i], cfg.max_len)
    windows, cur, cur_tokens = [], [], 0
    for i in torch.randperm(len(lengths), generator=g).tolist():
        if not lengths[i]:  # after the draw: leaving a sample out keeps every other run's plan
            continue
        cur.append(i)
        cur_tokens += n_of(i)
        if cur_tokens >= LENGTH_GROUP_BATCHES * cfg.batch_tokens:
            windows.append(cur)
            cur, cur_tokens = [], 0
    windows += [cur] if cur else []
    batches = []
    for w in windows:
        cur, cur_tokens = [], 0
        for i in sorted(w, key=n_of, reverse=True):
            if cur and cur_tokens + n_of(i) > cfg.batch_tokens:
                batches.append(cur)
                cur, cur_tokens = [], 0
            cur.append(i)
            cur_tokens += n_of(i)
        batches += [cur] if cur else []
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def trainable_lengths(ds, cfg: TrainConfig) -> tuple[list[int], int]:
    """Every sample's token count, 0 where training has nothing to supervise in its first max_len
    tokens (the response starts past max_len: a forward that teaches nothing), and how many those are.
    A sample counts iff step 0 supervises some position of it (ttt.step_masks; later steps see less)."""
    lengths = ds.sample_lengths()
    masks = ((torch.ones(n) for n in lengths) if cfg.supervise == "all"  # as real_positions in _train_step
             else ds.loss_masks())
    keep = []
    for m in masks:
        m = m[None, :cfg.max_len].bool()  # [1,T] as collate cuts it
        keep.append(bool(step_masks(m, torch.ones_like(m), 1)[0].any()))
    return [n if k else 0 for n, k in zip(lengths, keep)], keep.count(False)


def batch_plan(lengths: list[int], cfg: TrainConfig) -> list[list[int]]:
    """All global batches, in order (a pure function of lengths, seed and epoch: resume rebuilds it)."""
    plan = [b for epoch in range(cfg.epochs) for b in epoch_batches(lengths, cfg, epoch)]
    return plan[:cfg.max_steps] if cfg.max_steps else plan


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warmup = max(1, round(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- checkpoints (safetensors + JSON, atomic dir rename) -----------------------------------------
def named_trainable(draft: Eagle3Draft) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in draft.named_parameters() if p.requires_grad]


def save_checkpoint(out_dir: Path, draft: Eagle3Draft, opt: torch.optim.Optimizer, state: dict) -> None:
    tmp, final, old = out_dir / (CKPT + ".tmp"), out_dir / CKPT, out_dir / (CKPT + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(cpu_copy(draft.head_state_dict()), str(tmp / "model.safetensors"))
    optim = {"rng.torch": torch.get_rng_state()}
    for n, p in named_trainable(draft):
        for key, val in opt.state.get(p, {}).items():   # exp_avg, exp_avg_sq, step
            optim[f"{n}.{key}"] = val.detach().cpu().clone().reshape(val.shape).contiguous()
    save_file(optim, str(tmp / "optim.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def cpu_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What safetensors writes: every tensor on the CPU (a no-op for CPU tensors)."""
    return {k: v.detach().cpu() for k, v in tensors.items()}


def find_checkpoint(out_dir: Path) -> Path | None:
    for name in (CKPT, CKPT + ".old"):  # .old survives a kill between the two renames
        if (out_dir / name / "state.json").exists():
            return out_dir / name
    return None


def load_checkpoint(path: Path, draft: Eagle3Draft, opt: torch.optim.Optimizer) -> dict:
    draft.load_head_state_dict(load_file(str(path / "model.safetensors")))
    optim = load_file(str(path / "optim.safetensors"))
    torch.set_rng_state(optim.pop("rng.torch"))
    for n, p in named_trainable(draft):
        # moments on the parameter's device; AdamW keeps its step count on the CPU (not capturable)
        st = {k.split(".")[-1]: v if k.endswith(".step") else v.to(p.device)
              for k, v in optim.items() if k.rsplit(".", 1)[0] == n}
        if st:
            opt.state[p] = st
    return json.loads((path / "state.json").read_text())


def _maybe_resume(out_dir: Path, resume: bool, draft, opt, fingerprint: dict) -> tuple[int, list]:
    """(start step, metric history): from the checkpoint when resuming, else (0, [])."""
    ckpt = find_checkpoint(out_dir) if resume else None
    if ckpt is None:
        if resume:
            _log(f"no checkpoint in {out_dir}; starting at step 0")
        return 0, []
    try:
        state = load_checkpoint(ckpt, draft, opt)
        step, history, written_for = state["step"], state["history"], state["fingerprint"]
    except Exception as e:  # truncated safetensors, bad JSON, wrong shapes: all mean "unusable"
        why = (str(e).splitlines() or [""])[0][:200]
        raise ValueError(f"checkpoint {ckpt} is unreadable ({type(e).__name__}: {why}); rerun without "
                         f"--resume to start fresh, or delete {ckpt}") from None
    if "data_sha256" not in written_for:  # a checkpoint from before the data digest: the rest must agree
        fingerprint = {k: v for k, v in fingerprint.items() if k != "data_sha256"}
    # settings added since a checkpoint was written: it trained with what is now their default
    added = {k: v for k, v in LATER_SETTINGS.items() if k not in written_for.get("train", {})}
    written_for = {**written_for, "train": {**written_for.get("train", {}), **added}}
    if written_for != fingerprint:
        raise ValueError(f"checkpoint {ckpt} was written for a different run (data/config); "
                         "use a new --out or drop --resume")
    _log(f"resumed from {ckpt} at step {step}/{fingerprint['total_steps']}")
    return step, history


# ---- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(draft: Eagle3Draft, ds, indices: list[int], lm_head: torch.Tensor, cfg: TrainConfig) -> dict:
    """Per-step top-1 accuracy acc_k over ALL response positions (loss_mask[t+2+k] = 1): a hit needs the
    draft's argmax to be the target's top-1, so positions whose target top-1 lies outside the draft vocab
    count as misses — as they are at inference. acc_in_vocab_k is the training-loss view (those
    positions excluded). simulated_acceptance uses acc_k."""
    K, device = cfg.ttt_steps, lm_head.device
    loss_fn = TTTLoss(draft, K)
    correct, counted, counted_iv = (torch.zeros(K, dtype=torch.int64) for _ in range(3))
    loss_sum, n_batches = 0.0, 0
    lengths = [len(ds[i]["input_ids"]) for i in indices]
    for chunk in batch_plan(lengths, replace(cfg, epochs=1, max_steps=None)):
        batch = collate([ds[indices[i]] for i in chunk], cfg.max_len).to(device)
        tprobs, masks = batch_targets(batch, lm_head, draft, K)
        all_resp = step_masks(batch.loss_mask, torch.ones_like(batch.loss_mask), K)
        denom = torch.stack([m.sum() for m in masks])
        with autocast(cfg.dtype, device.type):
            loss, c, n = loss_fn(batch.aux_hidden, batch.input_ids, tprobs, masks, denom)
        correct += c.cpu()
        counted_iv += n.cpu()
        counted += torch.stack([m.sum() for m in all_resp]).cpu()
        loss_sum, n_batches = loss_sum + float(loss), n_batches + 1
    acc = [float(c) / max(1, int(n)) for c, n in zip(correct, counted)]
    return {"acc": acc, "acc_in_vocab": [float(c) / max(1, int(n)) for c, n in zip(correct, counted_iv)],
            "response_positions": counted.tolist(), "supervised": counted_iv.tolist(),
            "loss": loss_sum / max(1, n_batches), "simulated_acceptance": simulated_acceptance(acc),
            "samples": len(indices)}


# ---- training ------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


def prepare(target_dir, feature_dirs, out_dir: Path, cfg: TrainConfig, vocab_path, rank: int,
            device: torch.device = torch.device("cpu"), init_from=None):
    """Datasets, vocab, draft model (seeded init on the CPU, or a trained head's weights with
    `init_from`, then moved), frozen target lm_head, both on `device`."""
    from eagle3_platform.features.shards import ShardDataset
    from eagle3_platform.model.target import identity

    expect = identity(target_dir)
    hf = target_hf_config(target_dir)
    ds = ShardDataset(list(feature_dirs), expect=expect)
    vd = min(cfg.draft_vocab_size, hf["vocab_size"])
    if vocab_path:
        d2t, t2d, vstats = load_vocab(vocab_path)
    else:
        d2t, t2d, vstats = vocab_from_features(feature_dirs, hf["vocab_size"], vd, expect)
        if rank == 0:
            save_vocab(out_dir / VOCAB, d2t, t2d, vstats)
    dcfg = DraftConfig.from_target(hf, d2t.numel(), expect["capture_layer_ids"])
    torch.manual_seed(cfg.seed)
    draft = build_draft(target_dir, dcfg, cfg.init_from_target, d2t, t2d)
    warm = warm_start(draft, init_from, expect) if init_from else {}
    if warm:
        _log(f"warm start from {init_from}: {warm['lm_head_rows_kept']} lm_head rows kept, "
             f"{warm['lm_head_rows_new']} new")
    lm_head = target_head_weights(target_dir)["lm_head"].float().to(device)   # [V,H] frozen teacher head
    return ds, draft.to(device), lm_head, vstats, expect, warm


def train(target_dir, feature_dirs, out_dir, cfg: TrainConfig, resume: bool = False,
          eval_dirs=(), vocab_path=None, init_from=None) -> dict:
    """Train a head on the feature dirs; writes out_dir/{draft.safetensors, draft_config.json,
    metrics.json, vocab.safetensors}; returns the summary (also metrics.json). `init_from`: a draft
    dir to start from instead of a fresh init (warm_start)."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    feature_dirs = [str(d) for d in feature_dirs]
    if not feature_dirs:
        raise ValueError("no feature dirs given")
    set_threads(cfg.num_threads or 0)
    device = train_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = dist_setup(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds, draft, lm_head, vstats, expect, warm = prepare(target_dir, feature_dirs, out_dir, cfg, vocab_path, rank,
                                                       device, init_from)
    lengths, left_out = trainable_lengths(ds, cfg)
    if left_out and left_out == len(ds):  # a run of zero-loss steps would leave the head untrained
        raise ValueError(f"nothing to train: none of the {len(ds)} samples in {', '.join(feature_dirs)} has a "
                         f"response token within max_len={cfg.max_len}; raise max_len (the features hold "
                         f"up to {ds.header.get('max_length')} tokens a sample)")
    if left_out:
        _log(f"{left_out} of {len(ds)} samples have no response token within max_len={cfg.max_len}: left out")
    plan = batch_plan(lengths, cfg)
    total = len(plan)
    if not total:  # 0 steps would write an untrained head and report success
        raise ValueError(f"nothing to train: {len(ds)} samples in {', '.join(feature_dirs)} give 0 "
                         f"optimizer steps (epochs={cfg.epochs}, max_steps={cfg.max_steps})")
    params = [p for _, p in named_trainable(draft)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    # what determines the weights (thread count and device do not: they may change, and resume still works)
    fingerprint = {"feature_dirs": feature_dirs, "samples": len(ds), "data_sha256": ds.content_sha256(),
                   "train": {k: v for k, v in _cfg_dict(cfg).items() if k not in NOT_FINGERPRINTED},
                   "target": expect, "total_steps": total,
                   **({"init_sha256": warm["init_sha256"]} if warm else {})}
    start, history = _maybe_resume(out_dir, resume, draft, opt, fingerprint)
    # resolved after the fingerprint: `auto` stays the setting (a resumed run may compute otherwise)
    run_cfg = replace(cfg, dtype=resolve_dtype(cfg.dtype, device.type, work="dense"))
    top1 = TargetTop1(lm_head.to(getattr(torch, run_cfg.dtype)))  # cast once, not per teacher matmul
    model = TTTLoss(draft, cfg.ttt_steps)
    ddp = model if world == 1 else torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    K, t0, tokens = cfg.ttt_steps, time.time(), 0
    acc_c, acc_n, loss_acc, n_acc = torch.zeros(K), torch.zeros(K), 0.0, 0
    ticker, shown = Ticker("train", total, "steps") if rank == 0 else None, ""
    for step in range(start, total):
        stats, n_tok = _train_step(ddp, opt, params, ds, plan[step], top1, draft, run_cfg,
                                   lr_at(step, total, cfg), rank, world, step)
        loss_acc, n_acc = loss_acc + float(stats[0]), n_acc + 1
        acc_c, acc_n = acc_c + stats[1:1 + K], acc_n + stats[1 + K:]
        tokens += n_tok
        if (step + 1) % cfg.log_every == 0 or step + 1 == total:
            acc = (acc_c / acc_n.clamp(min=1)).tolist()
            # training view: acc over supervised positions (target top-1 in the draft vocab)
            history.append({"step": step + 1, "loss": loss_acc / n_acc, "lr": lr_at(step, total, cfg),
                            "acc": acc, "simulated_acceptance": simulated_acceptance(acc),
                            "supervised": acc_n.long().tolist()})  # positions per step k since the last entry
            shown = f"loss {loss_acc / n_acc:.3f}, acc0 {acc[0]:.3f}, "
            acc_c, acc_n, loss_acc, n_acc = torch.zeros(K), torch.zeros(K), 0.0, 0
        if ticker:  # stderr and, under Dagster, the run's log (eagle3_platform.progress)
            ticker.update(step + 1, f"{shown}{tokens / max(time.time() - t0, 1e-9):.0f} tok/s")
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == total:
            if rank == 0:
                save_checkpoint(out_dir, draft, opt, {"step": step + 1, "history": history,
                                                      "fingerprint": fingerprint})
            barrier()
    wall = time.time() - t0
    summary = {"out_dir": str(out_dir), "steps": total, "epochs": cfg.epochs, "resumed_from": start, "world_size": world,
               "samples": len(ds), "samples_left_out": left_out,
               "train_tokens": tokens, "train_tokens_per_s": tokens / wall if wall and tokens else None,
               "vocab": vstats, "history": history, "compute_dtype": run_cfg.dtype, "device": device.type,
               **({"warm_start": warm} if warm else {})}
    if rank == 0:
        summary.update(_final_eval(draft, ds, eval_dirs, expect, lm_head, run_cfg))
        # the lookup branch's second source (answer_ngrams.py), from the same train answers
        summary["answer_ngrams"] = AnswerNgrams.build(ds.response_spans(ANSWER_LEAD)).save(out_dir / ANSWERS)
        _write_outputs(out_dir, draft, cfg, expect, feature_dirs, summary)
        _log(f"done: {total} steps; train sim. acceptance {summary['train_eval']['simulated_acceptance']:.3f}")
    barrier()
    if rank != 0:  # every rank reports rank 0's (evaluated) summary
        summary = json.loads((out_dir / METRICS).read_text())
    return summary


def _train_step(ddp, opt, params, ds, batch_idx, top1: TargetTop1, draft, cfg: TrainConfig, lr: float,
                rank: int, world: int, step: int = 0) -> tuple[torch.Tensor, int]:
    """One optimizer step (number `step`) on this rank's share (samples rank::world) of a global batch.
    Returns ([global loss, correct_k..., counted_k...], global real tokens)."""
    K = cfg.ttt_steps
    local = batch_idx[rank::world]
    samples = local or batch_idx[:1]
    device = top1.lm_head.device
    batch = collate([ds[i] for i in samples], cfg.max_len).to(device)
    if cfg.supervise == "all":
        batch = replace(batch, loss_mask=real_positions(batch))
    with autocast(cfg.dtype, device.type):  # the teacher's matmuls too; its softmax is fp32 (ttt.teacher)
        tprobs, masks = batch_targets(batch, top1.lm_head, draft, K, (top1, samples))
    if not local:  # more ranks than samples: a zero-weight stand-in keeps DDP's collectives aligned
        masks = [torch.zeros_like(m) for m in masks]
    denom = all_sum(torch.stack([m.sum() for m in masks]))       # [K] global supervised counts
    for g in opt.param_groups:
        g["lr"] = lr
    aux = batch.aux_hidden
    if cfg.feature_noise:  # after the teacher: it reads last_hidden, never the noisy features
        aux = noisy_features(aux, draft.cfg.hidden_size, cfg.feature_noise,
                             cfg.seed * 1_000_003 + step * 97 + rank)
    with autocast(cfg.dtype, device.type):
        loss, c, n = ddp(aux, batch.input_ids, tprobs, masks, denom, float(world))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    stats = all_sum(torch.cat([loss.detach().reshape(1) / world, c.float(), n.float()]))
    return stats.cpu(), int(all_sum(batch.lengths.sum() if local else torch.tensor(0, device=device)))


def noisy_features(aux: torch.Tensor, H: int, a: float, seed: int) -> torch.Tensor:
    """aux [B,T,L·H] (L layers' features of width H side by side) -> aux + U(-a, a)·rms, rms per
    position and layer [B,T,L,1]; padding rows (all zero) stay zero. Drawn on aux's device (CPU and
    CUDA generators draw other streams: a run resumed on another device trains on other noise)."""
    B, T, LH = aux.shape
    x = aux.float().view(B, T, LH // H, H)                           # [B,T,L,H]
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()                     # [B,T,L,1]
    u = torch.rand(x.shape, generator=torch.Generator(x.device).manual_seed(seed), device=x.device) * 2 - 1
    return (x + a * rms * u).view(B, T, LH).to(aux.dtype)


def _final_eval(draft, ds, eval_dirs, expect, lm_head, cfg: TrainConfig) -> dict:
    from eagle3_platform.features.shards import ShardDataset

    draft.eval()
    out = {"train_eval": evaluate(draft, ds, list(range(min(len(ds), cfg.eval_samples))), lm_head, cfg)}
    if eval_dirs:
        eds = ShardDataset([str(d) for d in eval_dirs], expect=expect)
        out["eval"] = evaluate(draft, eds, list(range(len(eds))), lm_head, cfg)
        out["eval_simulated_acceptance"] = out["eval"]["simulated_acceptance"]
    out["train_simulated_acceptance"] = out["train_eval"]["simulated_acceptance"]
    return out


def _cfg_dict(cfg: TrainConfig) -> dict:
    d = asdict(cfg)
    d["betas"] = list(cfg.betas)
    return d


def save_draft_dir(out_dir, draft: Eagle3Draft, meta: dict | None = None) -> Path:
    """draft.safetensors (head weights + d2t/t2d) + draft_config.json ({"draft": DraftConfig, ...meta})."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / DRAFT_WEIGHTS, lambda p: save_file(cpu_copy(draft.head_state_dict()), str(p)))
    write_json_atomic(out_dir / DRAFT_CONFIG, {"draft": draft.cfg.to_dict(), **(meta or {})}, indent=2)
    return out_dir


def _write_outputs(out_dir: Path, draft: Eagle3Draft, cfg: TrainConfig, expect: dict, feature_dirs,
                   summary: dict) -> None:
    save_draft_dir(out_dir, draft, {"target": expect, "train": _cfg_dict(cfg), "feature_dirs": feature_dirs})
    write_json_atomic(out_dir / METRICS, summary, indent=2)


def load_draft_dir(draft_dir, target_dir) -> Eagle3Draft:
    """A trained head (draft.safetensors + draft_config.json) with the target's embedding."""
    meta, sd = read_draft_dir(draft_dir)
    draft = build_draft(target_dir, DraftConfig.from_dict(meta["draft"]), init_from_target=False)
    draft.load_head_state_dict(sd)
    return draft.eval()
