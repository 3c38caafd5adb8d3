"""Embedded server settings: typed, with named presets (no magic numbers in the handlers)."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"           # loopback by default: exposing the port is an explicit choice
    port: int = 8000                  # 0 = pick a free port (reported through --ready-file)
    max_tokens: int = 512             # server bound on a request's max_tokens (requests are clamped)
    default_max_tokens: int = 128     # when a request gives none
    max_queue: int = 64               # waiting + running requests; beyond this → 503
    max_batch: int = 16               # requests decoded together (continuous batching); others wait
    prefill_chunk: int = 256          # prompt tokens prefilled between two decode steps
    max_overtaken: int = 8            # shortest prompt first, but none is passed more than this often
    mixed_prefill_tokens: int = 128   # prompt tokens a running step carries (one forward); 0 = apart
    adaptive_draft: bool = True       # choose the draft size per step from measured cost/acceptance
    max_body_bytes: int = 1 << 20     # request bodies larger than this → 413
    # Against slow or hostile clients (a head or body that never finishes holds a connection):
    header_timeout_s: float = 10.0    # a request's head must arrive within this → else 408, closed
    body_timeout_s: float = 30.0      # ... and its body within this after the head → else 408
    max_header_bytes: int = 16 << 10  # request line + headers; longer → 431 (h11's own bound)
    max_headers: int = 100            # header fields; more → 431
    max_json_depth: int = 32          # nesting of the JSON body; deeper → 400
    keep_alive_s: float = 5.0         # an idle keep-alive connection is closed after this
    max_connections: int = 512        # open connections; beyond this uvicorn answers 503
    # Host names served when no API key is set, besides the loopback names and the bind address:
    # a web page that rebinds its own name to 127.0.0.1 sends its name as Host and is refused.
    allowed_hosts: tuple[str, ...] = ()
    max_stop: int = 4                 # OpenAI allows up to 4 stop strings
    shutdown_grace_s: float = 5.0     # in-flight requests get this long to finish on SIGTERM/SIGINT
    retry_after_s: int = 1            # Retry-After header on 503
    disconnect_poll_s: float = 0.5    # how often a waiting request checks that its client is there
    model_name: str | None = None     # /v1/models id; defaults to the target id
    # torch intra-op threads of the server's threads outside the engine's forwards and drafting
    # (sampling, bookkeeping). None = torch's default (every core): on 2 cores a baseline server
    # left so decodes 1.25x slower than on 1 (its threads contend).
    torch_threads: int | None = None
    # threads of the target's forwards (prefill, verify); 0 = every core, None = torch_threads. The
    # Locust sweep runs one endpoint at a time, so the loaded server may take both cores of a 2-core
    # machine (baseline throughput at concurrency 8 ~1.4x that on one thread).
    target_threads: int | None = None
    # threads of the head's drafting; 0 = every core, None = torch_threads. Whether a second thread
    # pays for the head's chain of small ops depends on the CPU (on some, two draft a batch-1 chain
    # 1.3x faster, on others one is faster): measure with bench_decode.py.
    draft_threads: int | None = None
    dtype: str = "auto"               # compute dtype of target + head (compute.resolve_dtype)
    device: str = "auto"              # auto | cpu | cuda | cuda:N of target + head + KV cache (target.pick_device)
    # Entries of each of oneDNN's two caches of matmul kernels, both keyed by the input's shape (a
    # packed linear meets a new row count with every prompt chunk length and batch x draft size).
    # At oneDNN's default (1024 each) a server's RSS grows by hundreds of MB before they fill; at
    # 256 it levels off within ~150 requests and decodes as fast (server.bound_kernel_caches).
    kernel_cache_entries: int = 256

    def with_(self, **kw) -> "ServeConfig":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


PRESETS: dict[str, ServeConfig] = {
    "tiny": ServeConfig(max_tokens=64, default_max_tokens=16, max_queue=32, torch_threads=1,
                        dtype="float32"),  # tests assert exact greedy losslessness (fp32)
    "demo": ServeConfig(max_tokens=256, default_max_tokens=64, max_queue=64, torch_threads=1,
                        target_threads=0, draft_threads=0),
    "cpu": ServeConfig(max_tokens=256, default_max_tokens=64, max_queue=64, torch_threads=1,
                       target_threads=0, draft_threads=0),
    "full": ServeConfig(max_tokens=4096, default_max_tokens=256, max_queue=256,
                        shutdown_grace_s=30.0),
}
