"""Hidden states an inference engine captured -> feature shards (docs/ARCHITECTURE.md §4,
docs/PRODUCTION.md "Capture through vLLM").

For a target served tensor-parallel (70B on 8 GPUs), the engine runs the forwards and this module only
converts its files. The format read is what vLLM's `extract_hidden_states` speculative method writes
through its ExampleHiddenStatesConnector (speculators' offline data generation moves the same files to
hs_<index>.safetensors): one safetensors file per request, no header metadata,
    hidden_states [T, K, H]  in the model dtype; slot k = boundary eagle_aux_hidden_state_layer_ids[k]
    token_ids     int64 [T]  the request's prompt ids
A boundary b is the residual stream after b decoder layers (0 = the embeddings), before the final
norm. This project's layer i is "the output of layer i" (capture.py), boundary i + 1; so a file must
hold the boundaries [l + 1 for l in capture_layer_ids] + [num_hidden_layers] (engine_layer_ids): the
three captured layers and the last layer's output. `last_hidden` (post-norm, the lm_head input) is
recomputed from that last slot with the target's own final norm module, in the file's dtype, as the
target's forward computes it. Shards store no logits (training recomputes them from last_hidden with
the frozen lm_head), so nothing else is needed.

The files do not say which boundaries they hold: the importer reads them from a file's metadata
(`eagle_aux_hidden_state_layer_ids`, a JSON list) or from DIR/speculative_config.json (the JSON given
to `vllm serve --speculative-config`), and refuses a directory where neither says them.

Each file is matched to a conversation record by its name (the request id, or the record id) or else
by its token ids; the ids must equal the record's input_ids (whole, or as truncated to max_length), or
the record is rejected. Torch pickles (SpecForge's .ckpt / .ckpt.gz, .pt, .pth, .bin) are refused
unread: unpickling runs code. Shards, manifest and resume are extract.write_features'.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_platform.features.extract import (STAGE, FeatureConfig, feature_header, load_records, open_sink,
                                              write_features)
from eagle3_platform.model.families import checkpoint_names, decoder
from eagle3_platform.model.target import read_meta
from eagle3_platform.store.records import Rejection
from eagle3_platform.store.storage import Storage

SPEC_CONFIG = "speculative_config.json"
LAYER_KEY = "eagle_aux_hidden_state_layer_ids"
PICKLES = (".ckpt", ".ckpt.gz", ".pt", ".pth", ".bin", ".pkl")
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _log(msg: str) -> None:
    print(f"[engine-import] {msg}", file=sys.stderr, flush=True)


def engine_layer_ids(meta: dict) -> list[int]:
    """The vLLM boundaries a file must hold for this prepared target: capture layers + 1, then the
    last layer's output (vLLM's and SGLang's input-of-layer convention; speculators' default
    [2, L//2, L-3, L] for capture_layer_ids [1, L//2-1, L-4])."""
    return [i + 1 for i in meta["capture_layer_ids"]] + [meta["num_hidden_layers"]]


def spec_config_json(meta: dict) -> str:
    """The `--speculative-config` JSON that makes vLLM write this target's boundaries."""
    return json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {LAYER_KEY: engine_layer_ids(meta)}}})


def _layer_ids_of(config: dict) -> list | None:
    """eagle_aux_hidden_state_layer_ids of a speculative config (nested as vLLM takes it, or top level)."""
    nested = ((config.get("draft_model_config") or {}).get("hf_config") or {}).get(LAYER_KEY)
    return nested if nested is not None else config.get(LAYER_KEY)


def dir_layer_ids(engine_dir: Path) -> list | None:
    path = engine_dir / SPEC_CONFIG
    if not path.exists():
        return None
    try:
        ids = _layer_ids_of(json.loads(path.read_text()))
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a speculative config JSON object ({e})") from None
    if not isinstance(ids, list):
        raise ValueError(f"{path} names no {LAYER_KEY}")
    return ids


# ---------------------------------------------------------------- scanning the engine's files

@dataclass
class EngineFile:
    path: Path
    name: str  # file stem: the request id (vLLM) or the name a client gave it
    token_ids: list[int]
    dtype: str  # torch dtype name of hidden_states


def _being_written(path: Path) -> bool:
    """vLLM holds an exclusive flock on <file>.lock while it writes <file>."""
    lock = path.with_name(path.name + ".lock")
    if not lock.exists():
        return False
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _check_file(path: Path, want_ids: list | None, expect: list[int], hidden: int) -> tuple[EngineFile | None, str]:
    """One file's header -> (EngineFile, "") or (None, reason). Reads the small token_ids tensor only."""
    if _being_written(path):
        return None, "engine:being_written"
    try:
        with safe_open(str(path), framework="pt") as f:
            keys, meta = set(f.keys()), f.metadata() or {}
            if not {"hidden_states", "token_ids"} <= keys:
                return None, "engine:keys"
            hs = f.get_slice("hidden_states")
            shape, dtype = hs.get_shape(), hs.get_dtype()
            ids = f.get_tensor("token_ids")
    except Exception:  # safetensors' parse errors: a truncated or garbled file
        return None, "engine:unreadable"
    if ids.dim() != 1 or ids.is_floating_point() or len(shape) != 3 or not shape[0] \
            or shape[0] != ids.numel():
        return None, "engine:seq_len"  # one state per token id, [T, K, H]
    if shape[2] != hidden:
        return None, "engine:hidden_size"
    if shape[1] != len(expect):
        return None, "engine:layer_count"
    if dtype not in DTYPES:
        return None, "engine:dtype"
    try:
        stated = json.loads(meta[LAYER_KEY]) if LAYER_KEY in meta else want_ids
    except json.JSONDecodeError:
        return None, "engine:layer_ids"
    if stated is None:
        raise ValueError(f"{path} does not say which layers it holds and {path.parent / SPEC_CONFIG} is "
                         f"missing: save the --speculative-config the engine ran with there "
                         f"(for this target: {json.dumps({'draft_model_config': {'hf_config': {LAYER_KEY: expect}}})})")
    if not isinstance(stated, list) or stated != expect:
        return None, "engine:layer_ids"
    return EngineFile(path, path.name.removesuffix(".safetensors"), ids.tolist(), DTYPES[dtype]), ""


def scan(engine_dir: str | Path, meta: dict) -> tuple[list[EngineFile], dict[str, str], dict]:
    """The usable files of a capture dir, the refused ones {file stem: reason}, and counters. One
    dtype per dataset: files in another dtype than the first usable one are refused."""
    engine_dir = Path(engine_dir)
    if str(engine_dir).startswith("gs://") or not engine_dir.is_dir():
        raise ValueError(f"engine capture dir {engine_dir} is not a local directory")
    pickles = sorted(p.name for p in engine_dir.iterdir() if p.name.endswith(PICKLES))
    if pickles:
        raise ValueError(f"{engine_dir} holds torch pickles ({', '.join(pickles[:3])}): refused unread, "
                         "unpickling runs code (SpecForge's .ckpt files are pickles); capture safetensors "
                         "with vLLM's extract_hidden_states instead")
    expect, want_ids = engine_layer_ids(meta), dir_layer_ids(engine_dir)
    if want_ids is not None and list(want_ids) != expect:
        raise ValueError(f"{engine_dir / SPEC_CONFIG}: the engine captured boundaries {want_ids}, this "
                         f"target needs {expect} (its capture layers {meta['capture_layer_ids']} + 1, then "
                         f"the last layer {meta['num_hidden_layers']}); capture again with {spec_config_json(meta)}")
    files, bad = [], {}
    for path in sorted(engine_dir.glob("*.safetensors")):
        got, reason = _check_file(path, want_ids, expect, meta["hidden_size"])
        if got and files and got.dtype != files[0].dtype:
            got, reason = None, "engine:dtype_mixed"
        if got:
            files.append(got)
        else:
            bad[path.name.removesuffix(".safetensors")] = reason
    if not files and not bad:
        raise ValueError(f"no *.safetensors capture files in {engine_dir}")
    return files, bad, {"files": len(files) + len(bad), "bad_by_reason": dict(Counter(bad.values())),
                        "layer_ids": expect}


# ---------------------------------------------------------------- matching files to records

def _digest(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


def _same(file: EngineFile, sample: dict) -> bool:
    """The file's ids are the record's: all of them, or the record as truncated to max_length."""
    return file.token_ids in (sample["full_input_ids"], sample["input_ids"])


def match(samples: list[dict], files: list[EngineFile], bad: dict[str, str]) -> tuple[list[dict], list[Rejection], int]:
    """Samples with their `engine_file`, rejections (engine:token_ids when the file named after the
    record holds other tokens; the refused file's reason; engine:no_file), and how many files matched
    no record. A file named after a record is that record's; others match by token ids."""
    by_name = {f.name: f for f in files}
    by_digest: dict[str, list[EngineFile]] = {}
    for f in files:
        by_digest.setdefault(_digest(f.token_ids), []).append(f)
    kept, rejected, used = [], [], set()
    for s in samples:
        f, reason = by_name.get(s["id"]), ""
        if f is not None and not _same(f, s):
            f, reason = None, "engine:token_ids"
        elif f is None and s["id"] in bad:
            reason = bad[s["id"]]
        elif f is None:
            candidates = by_digest.get(_digest(s["full_input_ids"]), []) + by_digest.get(_digest(s["input_ids"]), [])
            f = next((c for c in candidates if _same(c, s)), None)
            reason = "" if f else "engine:no_file"
        if f is None:
            rejected.append(Rejection(id=s["id"], workload=s["workload"], source=s["source"], stage=STAGE,
                                      reason=reason))
            continue
        used.add(f.path)
        kept.append({**s, "engine_file": f.path})
    return kept, rejected, sum(f.path not in used for f in files)


# ---------------------------------------------------------------- the final norm, and the features

def final_norm(target_dir: str | Path, dtype: str) -> torch.nn.Module:
    """The target's own final norm module (its family's class, eps and offset), its weights read from
    the checkpoint alone: the model is built on the meta device, so no layer is loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norm = decoder(model).norm.to_empty(device="cpu")
    prefixes = [n.removesuffix(".weight") for n in checkpoint_names(config, "norm")]
    want = {k: [f"{p}.{k}" for p in prefixes] for k in norm.state_dict()}
    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for k, options in want.items():
                hit = next((n for n in options if n in names), None)
                if hit and k not in found:
                    found[k] = f.get_tensor(hit)
    if missing := sorted(set(want) - set(found)):
        raise ValueError(f"target {target_dir}: its final norm's {missing} are in no checkpoint file "
                         f"(looked for {[o for k in missing for o in want[k]]})")
    norm.load_state_dict(found)
    return norm.to(getattr(torch, dtype)).eval()


@torch.inference_mode()
def read_features(chunk: list[dict], norm: torch.nn.Module, dtype: str) -> list[dict]:
    """Samples + aux_hidden [T,3H] / last_hidden [T,H] in the stored dtype, from their engine files."""
    out = []
    for s in chunk:
        T = len(s["input_ids"])
        with safe_open(str(s["engine_file"]), framework="pt") as f:
            hs = f.get_slice("hidden_states")[:T]  # [T,4,H]: three captured boundaries, then the last
        if not torch.isfinite(hs).all():
            raise ValueError(f"{s['engine_file']}: non-finite hidden states; remove the file and rerun "
                             "(its record is then rejected as engine:no_file)")
        aux = hs[:, :3].reshape(T, -1)  # [T,3,H] -> [T,3H], layers in capture order
        last = norm(hs[:, 3])  # [T,H] pre-norm -> post-norm: what the target's forward hands its lm_head
        store = getattr(torch, dtype)
        out.append({k: v for k, v in s.items() if k not in ("engine_file", "full_input_ids")}
                   | {"aux_hidden": aux.to(store), "last_hidden": last.to(store)})
    return out


def _tokenizer(target_dir: Path):
    """The tokenizer as load_target sets it up (its pad token is part of the template hash)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def import_engine_dir(target_dir: str | Path, engine_dir: str | Path, conv_path: str | Path,
                      out_dir: str | Path, cfg: FeatureConfig, storage: Storage | None = None,
                      prefix: str = "") -> dict:
    """Engine capture files + conversation records -> shards + manifest.parquet + rejected.jsonl in
    out_dir, as extract_file writes them (same header, resume, accounting). Returns the summary, with
    `engine`: files read, matched, matching no record, refused by reason."""
    t0 = time.perf_counter()
    target_dir = Path(target_dir)
    meta = read_meta(target_dir)
    files, bad, counts = scan(engine_dir, meta)
    compute_dtype = files[0].dtype if files else "bfloat16"  # no usable file: every record is rejected
    header = feature_header(meta, _tokenizer(target_dir), cfg, compute_dtype)
    sink = open_sink(out_dir, storage, prefix)
    samples, rejected, stats = load_records(conv_path, header, cfg.max_length, meta["vocab_size"], keep_full=True)
    kept, missing, unmatched = match(samples, files, bad)
    _log(f"{len(files)} usable capture files of {counts['files']}: {len(kept)} records matched, "
         f"{len(missing)} without one, {unmatched} files matching no record")
    norm = final_norm(target_dir, compute_dtype)
    summary = write_features(sink, conv_path, header, kept, rejected + missing, stats, cfg.samples_per_shard,
                             lambda chunk: read_features(chunk, norm, cfg.dtype), t0)
    summary["engine"] = {"dir": str(engine_dir), **counts, "matched": len(kept), "unmatched_files": unmatched}
    return summary
