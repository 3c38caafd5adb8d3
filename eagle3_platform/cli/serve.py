"""`eagle3 serve`: the embedded OpenAI-compatible server (baseline without --draft)."""
from __future__ import annotations

import logging
import os

from eagle3_platform.cli.args import require_positive
from eagle3_platform.serve.config import PRESETS
from eagle3_platform.spec.config import HEAD_WEIGHTS
from eagle3_platform.store.checks import output_file


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="serve the target (+ EAGLE-3 draft) over an OpenAI-compatible API")
    p.add_argument("--target", required=True, help="prepared target directory")
    p.add_argument("--draft", default=None, help="exported draft directory (omit for the baseline)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (0 = pick a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $EAGLE3_API_KEY if set)")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="without an API key, also serve requests whose Host is NAME (repeatable; "
                        "loopback names and the bind address are always served)")
    p.add_argument("--spec", default="chain",
                   help="speculative preset: chain | chain_adaptive | chain_adaptive_lookup | tree | tiny")
    p.add_argument("--head-weights", default=None, choices=HEAD_WEIGHTS,
                   help="the head's weights: auto (default: int4 where the target decodes on 4-bit codes, "
                        "else packed) | packed (oneDNN's blocked layout) | int8 | int4 | native")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="in plain steps of a request alone whose own text has no 2-token match, draft up to "
                        "this many tokens from the export's answer n-gram table (lookup specs; 0 = off, the "
                        "default)")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="server limits preset")
    p.add_argument("--max-tokens", type=int, default=None, help="server bound on max_tokens")
    p.add_argument("--max-queue", type=int, default=None, help="queued+running requests bound")
    p.add_argument("--max-batch", type=int, default=None, help="requests decoded together")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled between two decode steps (TTFT vs stream stalls)")
    p.add_argument("--max-overtaken", type=int, default=None,
                   help="prefill order: shortest prompt first, none passed more than this often (0: FIFO)")
    p.add_argument("--mixed-prefill-tokens", type=int, default=None,
                   help="prompt tokens a running decode step carries in its forward (0: prefill apart)")
    p.add_argument("--fixed-draft", action="store_true",
                   help="always verify the spec preset's full draft (no per-step draft size choice)")
    p.add_argument("--model-name", default=None, help="id shown by /v1/models")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of the rest: sampling, bookkeeping (default: the preset's)")
    p.add_argument("--target-threads", type=int, default=None,
                   help="torch CPU threads of the target's forwards; 0 = every core (default: the preset's)")
    p.add_argument("--draft-threads", type=int, default=None,
                   help="torch CPU threads of the head's drafting; 0 = every core (default: the preset's)")
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32 (default: the preset's)")
    p.add_argument("--ready-file", default=None, help="write {url, port, pid} here once bound")
    p.set_defaults(func=serve)


def serve(a) -> dict:
    from eagle3_platform.serve.server import (API_KEY_ENV, bind_socket, bound_kernel_caches, build_app,
                                              build_engine, check_api_key, run_server)

    output_file(a.ready_file, "--ready-file")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    require_positive(max_tokens=a.max_tokens, max_queue=a.max_queue, max_batch=a.max_batch,
                     prefill_chunk=a.prefill_chunk, threads=a.threads)
    for flag, n, zero in (("--answer-tokens", a.answer_tokens, "off"),
                          ("--target-threads", a.target_threads, "every core"),
                          ("--draft-threads", a.draft_threads, "every core")):
        if n is not None and n < 0:
            raise ValueError(f"{flag} must be >= 0 (0 = {zero}), not {n}")
    api_key = a.api_key or os.environ.get(API_KEY_ENV)
    check_api_key(api_key)  # before the model loads: a key no client can send is a startup error
    cfg = PRESETS[a.preset].with_(host=a.host, port=a.port, max_tokens=a.max_tokens,
                                  max_queue=a.max_queue, max_batch=a.max_batch,
                                  prefill_chunk=a.prefill_chunk, max_overtaken=a.max_overtaken,
                                  mixed_prefill_tokens=a.mixed_prefill_tokens,
                                  adaptive_draft=False if a.fixed_draft else None,
                                  model_name=a.model_name,
                                  torch_threads=a.threads, target_threads=a.target_threads,
                                  draft_threads=a.draft_threads,
                                  dtype=a.dtype,
                                  allowed_hosts=tuple(a.allowed_host) if a.allowed_host else None)
    kernel_caches = bound_kernel_caches(cfg.kernel_cache_entries)  # before any torch op
    if cfg.torch_threads:
        import torch
        torch.set_num_threads(cfg.torch_threads)
    sock = bind_socket(cfg.host, cfg.port)  # before the model loads: a busy port fails at once
    engine, target, info = build_engine(a.target, a.draft, a.spec, cfg.dtype, a.head_weights,
                                        cfg.target_threads, cfg.draft_threads, a.answer_tokens)
    context = int(getattr(target.model.config, "max_position_embeddings", 2048))
    name = info["target_id"] + ("-eagle3" if info["draft"] else "")
    app = build_app(engine, target.tokenizer, cfg, model_name=name, context_length=context,
                    api_key=api_key, info={**info, "kernel_cache_entries": kernel_caches})
    return run_server(app, cfg, ready_file=a.ready_file, sock=sock)
