"""`eagle3 serve`: the embedded OpenAI-compatible server (baseline without --draft); `eagle3 stop`:
the servers a data dir's runs recorded (the persistent deployment, a killed run's leftovers)."""
from __future__ import annotations

import logging
import os

from eagle3_platform.cli.args import require_positive
from eagle3_platform.serve.config import PRESETS
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
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="server limits preset")
    p.add_argument("--max-tokens", type=int, default=None, help="server bound on max_tokens")
    p.add_argument("--max-queue", type=int, default=None, help="queued+running requests bound")
    p.add_argument("--max-batch", type=int, default=None, help="requests decoded together")
    p.add_argument("--model-name", default=None, help="id shown by /v1/models")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of every part of the server; 0 = the target's forwards and the "
                        "head's drafting take every core (default: the preset's split)")
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32 (default: the preset's)")
    p.add_argument("--device", default=None,
                   help="auto | cpu | cuda | cuda:N: where the target, the head and the KV cache live; auto = "
                        "CUDA where torch sees a GPU (default: the preset's, auto)")
    p.add_argument("--ready-file", default=None, help="write {url, port, pid} here once bound")
    p.set_defaults(func=serve)

    p = sub.add_parser("stop", help="stop the persistent deployment (and any killed run's leftover servers) "
                                    "recorded under a data dir")
    p.add_argument("--data-dir", default=None,
                   help="the runs' local data dir (default: $EAGLE3_DATA_DIR or <project>/data)")
    p.add_argument("--list", action="store_true", help="only list the recorded servers and whether each is up")
    p.set_defaults(func=stop)


def serve_config(a):
    """The preset's ServeConfig with the command line's overrides. --threads N pins every role's
    threads alike (a shared box); 0 gives the target and the head every core; the scheduler's and
    the drafting policy's constants stay the preset's (serve/config.py)."""
    require_positive(max_tokens=a.max_tokens, max_queue=a.max_queue, max_batch=a.max_batch)
    if a.threads is not None and a.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = every core), not {a.threads}")
    roles = {} if a.threads is None else {"target_threads": a.threads, "draft_threads": a.threads,
                                          "torch_threads": a.threads or None}
    return PRESETS[a.preset].with_(host=a.host, port=a.port, max_tokens=a.max_tokens, max_queue=a.max_queue,
                                   max_batch=a.max_batch, model_name=a.model_name, dtype=a.dtype, device=a.device,
                                   allowed_hosts=tuple(a.allowed_host) if a.allowed_host else None, **roles)


def serve(a) -> dict:
    from eagle3_platform.serve.server import (API_KEY_ENV, bind_socket, bound_kernel_caches, build_app,
                                              build_engine, check_api_key, run_server)

    output_file(a.ready_file, "--ready-file")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = serve_config(a)
    api_key = a.api_key or os.environ.get(API_KEY_ENV)
    check_api_key(api_key)  # before the model loads: a key no client can send is a startup error
    from eagle3_platform.model.target import pick_device
    pick_device(cfg.device)  # before the model loads: a device asked for and absent is a startup error
    kernel_caches = bound_kernel_caches(cfg.kernel_cache_entries)  # before any torch op
    if cfg.torch_threads:
        import torch
        torch.set_num_threads(cfg.torch_threads)
    sock = bind_socket(cfg.host, cfg.port)  # before the model loads: a busy port fails at once
    engine, target, info = build_engine(a.target, a.draft, a.spec, cfg.dtype, device=cfg.device,
                                        target_threads=cfg.target_threads, draft_threads=cfg.draft_threads)
    context = int(getattr(target.model.config, "max_position_embeddings", 2048))
    name = info["target_id"] + ("-eagle3" if info["draft"] else "")
    app = build_app(engine, target.tokenizer, cfg, model_name=name, context_length=context,
                    api_key=api_key, info={**info, "kernel_cache_entries": kernel_caches})
    return run_server(app, cfg, ready_file=a.ready_file, sock=sock)


def stop(a) -> dict:
    """Stops (or with --list only lists) the servers recorded under DATA_DIR/servers: the persistent
    deployment and transient servers whose run is gone. A running step's own servers are left to it."""
    from pathlib import Path

    from eagle3_platform.cli.run import PROJECT_ROOT
    from eagle3_platform.serve.launch import REGISTRY_DIR, ServerRegistry

    data_dir = Path(a.data_dir or os.environ.get("EAGLE3_DATA_DIR") or PROJECT_ROOT / "data")
    if not data_dir.is_dir():
        raise FileNotFoundError(f"--data-dir {data_dir}: no such directory")
    registry = ServerRegistry(data_dir / REGISTRY_DIR)
    servers = [{**{k: r[k] for k in ("pid", "role", "url", "persistent", "owned")}, "up": _up(r["url"])}
               for r in registry.entries()]
    if a.list:
        return {"data_dir": str(data_dir), "servers": servers}
    stopped = registry.stop()
    return {"data_dir": str(data_dir), "stopped": stopped,
            "left_running": [s for s in servers if s["pid"] not in stopped]}


def _up(url: str | None) -> bool:
    """Whether the server answers /health now (which needs no API key)."""
    import httpx

    try:
        return bool(url) and httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False
