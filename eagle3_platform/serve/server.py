"""Embedded OpenAI-compatible server (Starlette + uvicorn) over one speculative engine.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE streaming or full JSON),
GET /v1/models, GET /health, GET /server_info (SGLang-compatible `avg_spec_accept_length`).
The engine is injected (`build_app(engine, tokenizer, ...)`), so tests run with a fake;
`build_engine(target_dir, draft_dir, spec)` builds the real one. Prompt and output text never reach
the logs (they may hold PII): only request ids, token counts, timings, exception types.

A request to a completion route ends in exactly one outcome counted in /server_info (ok, rejected,
disconnected, failed: they sum to requests_total). Anything wrong with the request itself is a 4xx
naming what (access, headers, body size and deadline, JSON, schema, tokenization); a 500 is an engine
fault or a bug, logged with the request id. Without an API key only loopback names (and the bind
address, and cfg.allowed_hosts) are served as Host, and cross-origin requests are refused: a web page
the user visits can then neither rebind its name to this server nor post to it (a POST must also be
application/json, which a browser sends cross-origin only after a preflight, never answered here).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from eagle3_platform.draft.metrics import acceptance_length
from eagle3_platform.serve import protocol as P
from eagle3_platform.serve.config import PRESETS, ServeConfig  # noqa: F401  (PRESETS: preset lookup)
from eagle3_platform.serve.guard import guarded_h11
from eagle3_platform.serve.text import TextStream
from eagle3_platform.serve.worker import EngineWorker, Job, QueueFull
from eagle3_platform.spec.policy import DraftSizePolicy
from eagle3_platform.store.records import write_json_atomic

log = logging.getLogger("eagle3.serve")
API_KEY_ENV = "EAGLE3_API_KEY"
SSE_DONE = b"data: [DONE]\n\n"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# A body over the bound is still read (and dropped) up to this many times the bound before the 413:
# the client is usually still sending, and closing on unread data resets the connection, which it
# sees instead of the answer. Beyond that the answer goes at once and the connection closes.
DRAIN_FACTOR = 8


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def check_api_key(key: str | None) -> None:
    """A key a client can send: printable ASCII (HTTP header values are ASCII in practice; httpx and
    requests refuse anything else), no surrounding whitespace (the server strips the sent token)."""
    if key is not None and not (key.isascii() and key.isprintable() and key == key.strip()):
        raise ValueError("API key (--api-key / $EAGLE3_API_KEY) must be printable ASCII "
                         "without surrounding spaces: clients cannot send any other key in a header")


def error_response(e: P.APIError, rid: str | None = None) -> JSONResponse:
    headers = {**e.headers, **({"X-Request-Id": rid} if rid else {})}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def host_name(value: str) -> str:
    """The name of a Host (or Origin netloc) value: no port, brackets, trailing dot; lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        name = value[1:value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
        name = name if port.isdigit() or not port else value
    else:
        name = value
    return name.rstrip(".")


class Outcome:
    """One request's outcome, counted once: ok | rejected | disconnected | failed."""

    def __init__(self, counts: dict):
        self.counts, self.kind = counts, None
        counts["requests_total"] += 1

    def __call__(self, kind: str) -> None:
        if self.kind is None:
            self.kind = kind
            self.counts[f"requests_{kind}"] += 1


class TrackedStream(StreamingResponse):
    """A streaming answer that still settles its request when its stream was cut or never began:
    Starlette cancels the body iterator when the client leaves, so no exception of ours reaches it
    (and one cancelled before its first step never runs its own handlers)."""

    def __init__(self, content, outcome: Outcome, job: Job, **kw):
        super().__init__(content, **kw)
        self.outcome, self.job = outcome, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()      # a job whose stream never started still frees its slot
            self.outcome("disconnected")  # a no-op where the stream counted its own outcome


class EngineFailure(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class Service:
    """Request handling. One instance per app; the worker owns the engine."""

    def __init__(self, engine, tokenizer, cfg: ServeConfig, *, model_name: str,
                 context_length: int, api_key: str | None = None, info: dict | None = None):
        self.cfg = cfg
        # A private tokenizer copy: the engine thread may use the original concurrently, and a fast
        # tokenizer's encode mutates its truncation state ("Already borrowed" under contention).
        self.tok = copy.deepcopy(tokenizer)
        self.model_name = model_name
        self.context_length = context_length
        check_api_key(api_key or None)
        self.api_key = api_key or None
        self.info = info or {}
        self.worker = EngineWorker(engine, cfg.max_queue, cfg.max_batch, cfg.prefill_chunk,
                                   draft_size_policy(engine, cfg), cfg.max_overtaken,
                                   cfg.mixed_prefill_tokens)
        self.started = time.time()
        self.counts = {"requests_total": 0, "requests_rejected": 0, "requests_ok": 0,
                       "requests_failed": 0, "requests_disconnected": 0}
        self.hosts = frozenset(host_name(h) for h in (*LOOPBACK_NAMES, cfg.host, *cfg.allowed_hosts))

    # -- plumbing --------------------------------------------------------------------------------
    def check_access(self, request: Request) -> None:
        """Headers bounded; without an API key, a served Host and no foreign Origin; else the key."""
        if len(request.headers.raw) > self.cfg.max_headers:
            raise P.APIError(431, f"more than {self.cfg.max_headers} header fields")
        if self.api_key is not None:
            self.check_auth(request)
            return
        host = request.headers.get("host")
        if host is not None and host_name(host) not in self.hosts:
            raise P.APIError(421, "this server does not serve that Host name (without an API key it "
                                  "answers only its loopback names and bind address)", param="host")
        origin = request.headers.get("origin")
        if origin is not None and host_name(urlsplit(origin).netloc or origin) not in self.hosts:
            raise P.APIError(403, "cross-origin requests are refused when no API key is set",
                             param="origin")

    def check_auth(self, request: Request) -> None:
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        # bytes: compare_digest refuses non-ASCII str (a TypeError → 500 for a client's typo);
        # headers arrive latin-1 decoded, so encoding back gives the bytes that were sent
        sent, want = token.strip().encode("latin-1"), self.api_key.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, want):
            raise P.APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                             type_="authentication_error")

    @staticmethod
    def check_content_type(request: Request) -> None:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise P.APIError(415, "Content-Type must be application/json", param="content-type")

    async def read_body(self, request: Request) -> bytes:
        """The body, within cfg.max_body_bytes and cfg.body_timeout_s. One 413 path: a larger body,
        declared or not, is drained up to DRAIN_FACTOR x the bound and then refused."""
        limit, cap = self.cfg.max_body_bytes, DRAIN_FACTOR * self.cfg.max_body_bytes
        too_large = P.APIError(413, f"request body larger than {limit} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
            too_large.headers["Connection"] = "close"
            raise too_large
        body, size = bytearray(), 0
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                async for part in request.stream():
                    size += len(part)
                    if size <= limit:
                        body += part
                    elif size > cap:
                        too_large.headers["Connection"] = "close"
                        break
        except TimeoutError:
            raise P.APIError(408, f"request body not received within {self.cfg.body_timeout_s:g} s",
                             headers={"Connection": "close"}) from None
        except ClientDisconnect:  # upload cut mid-body: nobody to answer, nothing to log but a line
            raise ClientGone() from None
        if size > limit:
            raise too_large
        return bytes(body)

    async def parse(self, request: Request, chat: bool, rid: str) -> tuple[P.SamplingRequest, list[int]]:
        """Access, headers, body, JSON, schema, tokens: every failure is an APIError (a 4xx)."""
        self.check_access(request)
        self.check_content_type(request)
        body = await self.read_body(request)
        phase = "parsing the body"
        try:
            obj = P.parse_body(body, self.cfg.max_json_depth)
            phase = "validating the request"
            req = P.validate(P.ChatRequest if chat else P.CompletionRequest, obj)
            phase = "tokenizing the prompt"
            ids = self.encode_chat(req) if chat else self.encode_text(req.prompt_text())
        except P.APIError:
            raise
        except Exception as e:  # whatever else the request's content trips is still the request's
            log.warning("request %s: %s failed: %s", rid, phase, type(e).__name__)
            raise P.APIError(400, f"request refused: {phase} failed ({type(e).__name__})") from None
        return req, ids

    def encode_chat(self, req: P.ChatRequest) -> list[int]:
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            out = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # template-level refusals (e.g. role order) are the client's error
            raise P.APIError(400, f"messages rejected by the chat template: {type(e).__name__}",
                             param="messages") from None
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def encode_text(self, text: str) -> list[int]:
        try:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        except Exception as e:
            raise P.APIError(400, f"prompt rejected by the tokenizer: {type(e).__name__}",
                             param="prompt") from None
        return [int(i) for i in ids]

    def budget(self, req: P.SamplingRequest, n_prompt: int) -> int:
        """max_tokens clamped by the server bound and by what is left of the context."""
        room = self.context_length - n_prompt
        if n_prompt == 0:
            raise P.APIError(400, "the prompt is empty", param="messages")
        if room < 1:
            raise P.APIError(400, f"prompt is {n_prompt} tokens; the context holds "
                                  f"{self.context_length}", param="messages")
        if len(req.stop_list()) > self.cfg.max_stop:
            raise P.APIError(400, f"at most {self.cfg.max_stop} stop strings", param="stop")
        asked = req.requested_max_tokens() or self.cfg.default_max_tokens
        return min(asked, self.cfg.max_tokens, room)

    def submit(self, ids: list[int], req: P.SamplingRequest, max_new: int) -> tuple[Job, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(ev):
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                loop.call_soon_threadsafe(events.put_nowait, ev)

        job = Job(ids, max_new, float(req.temperature), tuple(req.stop_list()), req.seed, emit)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise P.APIError(503, str(e), type_="server_overloaded",
                             headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        return job, events

    async def next_event(self, events: asyncio.Queue, request: Request | None, job: Job,
                         polled: list[float]):
        """The worker's next event; meanwhile poll the client every cfg.disconnect_poll_s so a
        departed client's job is cancelled (and skipped if still queued) instead of occupying the
        engine. The poll is timed, not tied to a quiet queue: a decode emits faster than the poll
        interval. polled[0]: the last poll's loop time."""
        loop, every = asyncio.get_running_loop(), self.cfg.disconnect_poll_s
        getter = asyncio.ensure_future(events.get())
        try:
            while True:
                left = max(0.0, polled[0] + every - loop.time())
                done, _ = await asyncio.wait({getter}, timeout=left)
                if request is not None and loop.time() >= polled[0] + every:
                    polled[0] = loop.time()
                    if await request.is_disconnected():
                        job.cancelled.set()
                        raise ClientGone()
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def generate(self, job: Job, events: asyncio.Queue, n_prompt: int,
                       request: Request | None = None, rid: str = "-"):
        """Yield ("text", delta)… then ("end", finish_reason, usage). Cancels the job if abandoned."""
        ts = TextStream(self.tok, job.stop)
        n_out, info, polled = 0, {}, [asyncio.get_running_loop().time()]
        try:
            while True:
                kind, val = await self.next_event(events, request, job, polled)
                if kind == "error":
                    raise EngineFailure(val)
                if kind == "done":
                    info = val
                    break
                n_out += len(val)
                delta = ts.feed(val)
                if delta:
                    yield ("text", delta)
                if ts.stopped:  # stop string seen: the rest is not needed
                    job.satisfied = True
                    job.cancelled.set()
            tail = ts.flush()
            if tail:
                yield ("text", tail)
        finally:
            job.cancelled.set()  # client gone or done: either way the worker may stop
        finish = "stop" if ts.stopped else (info.get("finish_reason") or
                                             ("stop" if n_out < job.max_new_tokens else "length"))
        steps, accepted = int(info.get("verify_steps", 0)), int(info.get("accepted_tokens", 0))
        log.info("request %s: prompt_tokens=%d completion_tokens=%d verify_steps=%d finish=%s "
                 "%.2fs", rid, n_prompt, n_out, steps, finish, info.get("seconds", 0.0))
        yield ("end", finish, P.usage(n_prompt, n_out, steps, accepted))

    # -- handlers --------------------------------------------------------------------------------
    async def chat(self, request: Request):
        return await self._complete(request, chat=True)

    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool):
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        request.state.rid = rid  # for the crash handler's log line
        outcome = Outcome(self.counts)
        try:
            req, ids = await self.parse(request, chat, rid)
            max_new = self.budget(req, len(ids))
            job, events = self.submit(ids, req, max_new)
        except P.APIError as e:
            outcome("rejected")
            return error_response(e, rid)
        except ClientGone:
            outcome("disconnected")
            log.info("request %s: body incomplete, the client disconnected during upload", rid)
            return error_response(P.APIError(499, "client disconnected"), rid)
        stream = self.generate(job, events, len(ids), request, rid)
        if req.stream:
            return TrackedStream(self._sse(stream, rid, chat, req.include_usage(), outcome),
                                 outcome, job, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return await self._full(stream, rid, chat, outcome)

    async def _full(self, stream, rid: str, chat: bool, outcome: Outcome):
        parts, created = [], P.now()
        try:
            async for ev in stream:
                if ev[0] == "text":
                    parts.append(ev[1])
                else:
                    _, finish, use = ev
        except EngineFailure as e:
            outcome("failed")
            log.error("request %s: %s", rid, e)
            return error_response(P.APIError(500, str(e), type_="server_error"), rid)
        except ClientGone:
            outcome("disconnected")
            log.info("request %s: client disconnected, its generation was cancelled", rid)
            return error_response(P.APIError(499, "client disconnected"), rid)
        except Exception:  # a bug of ours: the crash handler answers 500
            outcome("failed")
            raise
        except BaseException:  # cancelled (the server stops)
            outcome("disconnected")
            raise
        outcome("ok")
        build = P.chat_response if chat else P.completion_response
        return JSONResponse(build(rid, self.model_name, created, "".join(parts), finish, use),
                            headers={"X-Request-Id": rid})

    async def _sse(self, stream, rid: str, chat: bool, include_usage: bool, outcome: Outcome):
        created, model = P.now(), self.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return P.chat_chunk(rid, model, created, delta, finish)
            return P.completion_chunk(rid, model, created, text or "", finish)

        try:
            if chat:
                yield sse(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                       None))
            async for ev in stream:
                if ev[0] == "text":
                    yield sse(chunk(ev[1], None))
                    continue
                _, finish, use = ev
                yield sse(chunk(None, finish))
                if include_usage:
                    yield sse(P.usage_chunk(rid, model, created, obj, use))
            outcome("ok")
        except EngineFailure as e:
            outcome("failed")
            log.error("request %s: %s", rid, e)
            yield sse(P.APIError(500, str(e), type_="server_error").body())
        except ClientGone:
            outcome("disconnected")
            return
        except Exception:
            outcome("failed")
            raise
        finally:  # cancelled when the client left: TrackedStream counts it
            await stream.aclose()
        yield SSE_DONE

    async def models(self, request: Request):
        try:
            self.check_access(request)
        except P.APIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(self.started),
             "owned_by": "eagle3-platform", "max_model_len": self.context_length}]})

    async def health(self, request: Request):
        alive = self.worker._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine worker stopped"},
                            status_code=200 if alive else 503)

    async def server_info(self, request: Request):
        try:
            self.check_access(request)
        except P.APIError as e:
            return error_response(e)
        return JSONResponse(self.server_info_dict())

    def server_info_dict(self) -> dict:
        t = self.worker.totals
        tau = acceptance_length(t.accepted_tokens, t.verify_steps)
        return {
            **self.info,
            "model": self.model_name,
            "context_length": self.context_length,
            "max_tokens": self.cfg.max_tokens,
            "max_queue": self.cfg.max_queue,
            # SGLang's key (older top-level form and newer internal_states form).
            "avg_spec_accept_length": tau,
            "internal_states": [{"avg_spec_accept_length": tau}],
            "generated_tokens": t.generated_tokens,
            "spec_accepted_tokens": t.accepted_tokens,
            "spec_verify_steps": t.verify_steps,
            **self.counts,
            "requests_completed": t.requests_completed,
            "requests_cancelled": t.requests_cancelled,
            "engine_errors": t.requests_failed,
            "queue_depth": max(0, self.worker.outstanding - self.worker.in_flight),  # read while jobs move
            "in_flight": self.worker.in_flight,
            **self.worker.info(),
            "uptime_s": round(time.time() - self.started, 3),
        }


# oneDNN's primitive cache and ideep's cache of computations (the layer torch's mkldnn ops go
# through): both read their capacity from the environment at their first use.
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int) -> dict:
    """Bound the caches of compiled matmul kernels keyed by input shape (cfg.kernel_cache_entries).
    Effective only before the process's first oneDNN op (before the target loads: packing its
    weights is one); a capacity already set in the environment wins. -> the capacities in force."""
    for name in KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(entries))
    return {name: int(os.environ[name]) for name in KERNEL_CACHE_ENV}


def draft_size_policy(engine, cfg: ServeConfig) -> DraftSizePolicy | None:
    """The per-step draft size choice, for an engine that drafts (the baseline has nothing to choose)."""
    spec = getattr(engine, "cfg", None)
    if not cfg.adaptive_draft or getattr(engine, "draft", None) is None or spec is None:
        return None
    return DraftSizePolicy(spec.num_draft_tokens - 1)


def build_app(engine, tokenizer, cfg: ServeConfig | None = None, *, model_name: str = "eagle3",
              context_length: int = 2048, api_key: str | None = None,
              info: dict | None = None) -> Starlette:
    cfg = cfg or ServeConfig()
    svc = Service(engine, tokenizer, cfg, model_name=cfg.model_name or model_name,
                  context_length=context_length, api_key=api_key, info=info)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        svc.worker.start()
        try:
            yield
        finally:
            svc.worker.stop(timeout=cfg.shutdown_grace_s)

    async def not_found(request, exc):
        return error_response(P.APIError(404, f"no route {request.url.path}"))

    async def bad_method(request, exc):
        return error_response(P.APIError(405, f"method {request.method} not allowed"))

    async def crash(request, exc):  # last resort: still JSON, never a traceback to the client
        # the frames' code lines, not the exception's message (it may quote the request's text)
        rid = getattr(request.state, "rid", "-")
        log.error("request %s: unhandled %s on %s\n%s", rid, type(exc).__name__, request.url.path,
                  "".join(traceback.format_tb(exc.__traceback__)).rstrip())
        return error_response(P.APIError(500, "internal server error", type_="server_error"),
                              rid if rid != "-" else None)

    app = Starlette(
        routes=[Route("/v1/chat/completions", svc.chat, methods=["POST"]),
                Route("/v1/completions", svc.completions, methods=["POST"]),
                Route("/v1/models", svc.models, methods=["GET"]),
                Route("/health", svc.health, methods=["GET"]),
                Route("/server_info", svc.server_info, methods=["GET"]),
                Route("/get_server_info", svc.server_info, methods=["GET"])],
        exception_handlers={404: not_found, 405: bad_method, Exception: crash},
        lifespan=lifespan)
    app.state.service = svc
    return app


def build_engine(target_dir: str | Path, draft_dir: str | Path | None = None, spec: str = "chain",
                 dtype: str = "auto", head_weights: str | None = None, target_threads: int | None = None,
                 draft_threads: int | None = None, answer_tokens: int | None = None, device: str = "cpu"):
    """The real engine from a prepared target (+ optional exported draft); head_weights and
    answer_tokens override the spec preset's (SpecConfig); target_threads, draft_threads: see
    SpecEngine (CPU only); device: 'auto' | 'cpu' | 'cuda' | 'cuda:N' (target.pick_device: one asked
    for and absent fails here, at startup). Imports torch lazily."""
    from dataclasses import replace

    import torch

    from eagle3_platform.model.compute import resolve_threads
    from eagle3_platform.model.target import load_target
    from eagle3_platform.spec.config import get_preset
    from eagle3_platform.spec.engine import SpecEngine

    target = load_target(target_dir, dtype=dtype, device=device)
    draft = answers = head_sha256 = None
    if draft_dir is not None:
        from eagle3_platform.draft.export import WEIGHTS_FILE, load_answer_ngrams, load_export
        from eagle3_platform.store.records import sha256_file
        draft = load_export(draft_dir, target)
        head_sha256 = sha256_file(Path(draft_dir) / WEIGHTS_FILE)  # which head this is (the report's header)
    cfg = get_preset(spec if draft is not None else "baseline")
    if head_weights is not None:
        cfg = replace(cfg, head_weights=head_weights)
    if answer_tokens is not None and draft is not None:
        cfg = replace(cfg, answer_tokens=answer_tokens)
    if cfg.answer_tokens and draft is not None:  # read only where it drafts (off by default)
        answers = load_answer_ngrams(draft_dir)
        if answers is None and answer_tokens:
            raise ValueError(f"answer_tokens {answer_tokens}: {draft_dir} has no answer n-gram table "
                             "(heads trained before it existed; train the head again)")
    engine = SpecEngine(target, draft, cfg, target_threads, draft_threads, answers)
    info = {"target_id": target.meta.get("target_id"), "draft": draft is not None,
            "device": str(engine.device), "dtype": target.meta["dtype"],
            "kv_cache_dtype": str(engine.cache_dtype).removeprefix("torch."),
            "wide_fp32_rows": target.meta.get("wide_fp32_rows", 0),
            "rowmajor_rows": target.meta.get("rowmajor_rows", 0),
            "int4_rows": target.meta.get("int4_rows", 0), "int4_linears": target.meta.get("int4_linears", 0),
            "spec": spec if draft is not None else "baseline", "spec_config": cfg.to_dict(),
            "head_weights": engine.head_weights,  # as resolved ('auto' -> int4 | packed)
            "head_sha256": head_sha256,  # the export's weights file: the head's identity
            # contexts in the answer table drafted from (None: answer_tokens 0, or the export has none)
            "answer_ngrams": len(answers) if answers is not None else None,
            "threads": {"rest": torch.get_num_threads(),  # sampling, bookkeeping
                        "head": torch.get_num_threads() if draft_threads is None
                        else resolve_threads(draft_threads),
                        "target": torch.get_num_threads() if target_threads is None
                        else resolve_threads(target_threads)}}
    return engine, target, info


class _Server:
    """uvicorn.Server whose signal handling ends in a normal return (exit 0), not a re-raise."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                sigs = (signal.SIGINT, signal.SIGTERM)
                old = {s: signal.signal(s, self.handle_exit) for s in sigs}
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)

        return Server(config)


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Starlette, cfg: ServeConfig, log_level: str = "info"):
    """uvicorn's settings from cfg: the h11 protocol (its head-size bound, with guard.py's head
    deadline), keep-alive, the connection bound, the shutdown grace."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                          http=guarded_h11(cfg.header_timeout_s, cfg.max_header_bytes),
                          h11_max_incomplete_event_size=cfg.max_header_bytes,
                          timeout_keep_alive=cfg.keep_alive_s,
                          limit_concurrency=cfg.max_connections,
                          timeout_graceful_shutdown=cfg.shutdown_grace_s)


def run_server(app: Starlette, cfg: ServeConfig, ready_file: str | Path | None = None,
               log_level: str = "info", sock: socket.socket | None = None) -> dict:
    """Serve until SIGTERM/SIGINT; in-flight requests get cfg.shutdown_grace_s to finish.
    `sock`: an already bound socket (bind before loading the model to fail fast on a busy port)."""
    sock = sock or bind_socket(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    if ready_file:
        write_json_atomic(ready_file, {"url": url, "port": port, "pid": os.getpid()})
    server = _Server.make(uvicorn_config(app, cfg, log_level))
    log.info("serving on %s", url)
    print(f"[serve] listening on {url}", flush=True)
    server.run(sockets=[sock])
    svc = app.state.service
    return {"url": url, **{k: v for k, v in svc.server_info_dict().items()
                           if k.startswith("requests") or k.startswith("spec_")}}
