"""Client for any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM, the embedded server).

Transient failures (connection errors, timeouts, 429, 5xx) are retried with jittered exponential
backoff, never sooner than the server's `Retry-After`. A 429/5xx still there after `max_retries`
retries rejects that one conversation (`endpoint:<status>`); a server that stays unreachable stops the
run. 401, 403 and 404 say the endpoint refuses every request (key, URL or model name): `EndpointRefused`
stops the run, so nothing is rejected for it and a rerun with the right settings resumes. Any other
4xx, and a reply that is not a chat completion, is that request's fault: `EndpointRequestError`, so
the caller rejects that one conversation. Regeneration's endpoint back end (`regenerate.run_endpoint`)
drives it, over one or several endpoints (`spread`: data-parallel, rows in input order).

Before any work each endpoint must list the model regeneration expects on `/v1/models`
(`check_served`): records are only trained on answers of the prepared weights.

Reasoning models answer with `reasoning_content` beside `content` (SGLang and vLLM with a reasoning
parser; some servers call it `reasoning`): both are kept, and regeneration decides with its `reasoning`
setting whether the thinking is trained. `reasoning="drop"` also asks the server's template not to
think (`chat_template_kwargs: {"enable_thinking": false}`, honoured by Qwen3's template).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Callable, Sequence

MAX_WAIT_S = 60.0  # longest single wait between tries (a Retry-After above it is cut to it)


class EndpointRequestError(ValueError):
    """The endpoint refused this request (4xx other than 429), or its reply is no chat completion:
    retrying will not help. `reason`: the rejection reason recorded for the conversation."""

    def __init__(self, status: int, detail: str, reason: str | None = None):
        super().__init__(f"endpoint answered {status}: {detail[:200]}")
        self.status = status
        self.reason = reason or f"endpoint:{status}"


class EndpointRefused(RuntimeError, ValueError):
    """The endpoint refuses every request (401/403/404), or does not serve the expected model: a setting
    is wrong, not a record (a ValueError too: the CLI's one-line error for bad input)."""


REFUSED = {401: "the API key", 403: "the API key", 404: "the URL or the model name"}


@dataclass(frozen=True)
class Reply:
    content: str
    finish_reason: str
    completion_tokens: int | None
    reasoning: str = ""  # the server's reasoning_content ("" when it returned none)


def chat_url(endpoint: str) -> str:
    """Accept `http://host:port`, `.../v1` or the full `.../v1/chat/completions`."""
    base = endpoint.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


class ChatClient:
    def __init__(self, endpoint: str, model: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_retries: int = 5, backoff_s: float = 0.5):
        import httpx

        self.url = chat_url(endpoint)
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.retries = 0  # tries repeated (all threads): the run's summary reports them
        self._lock = threading.Lock()
        self._rng = random.Random()  # jitter only: it never reaches a record
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, top_p: float,
             seed: int | None, reasoning: str = "keep") -> Reply:
        """One completion. Messages go as role + content only (the server's template renders history)."""
        body = {"model": self.model, "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stream": False}
        if seed is not None:
            body["seed"] = seed
        if reasoning == "drop":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return parse_reply(self._post(body))

    def _post(self, body: dict) -> dict:
        import httpx

        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            retry_after = None
            try:
                r = self._http.post(self.url, json=body)
            except httpx.TransportError as e:  # connection refused/reset, timeouts
                if last:
                    raise RuntimeError(f"endpoint {self.url} unreachable after {attempt + 1} tries: {e}") from e
            else:
                if r.status_code < 400:
                    try:
                        return r.json()
                    except ValueError:
                        raise EndpointRequestError(r.status_code, "reply is not JSON", "endpoint:bad_reply")
                if r.status_code in REFUSED:
                    raise EndpointRefused(f"endpoint {self.url} refused the request ({r.status_code}): check "
                                          f"{REFUSED[r.status_code]}")
                if r.status_code != 429 and r.status_code < 500:
                    raise EndpointRequestError(r.status_code, r.text)
                if last:  # busy for this conversation's whole retry budget: it is rejected, the run goes on
                    raise EndpointRequestError(r.status_code, f"still {r.status_code} after {attempt + 1} tries")
                retry_after = retry_after_s(r.headers.get("retry-after"))
            with self._lock:
                self.retries += 1
            time.sleep(self.wait_s(attempt, retry_after))
        raise AssertionError("unreachable")

    def wait_s(self, attempt: int, retry_after: float | None) -> float:
        """backoff_s * 2^attempt, at least the server's Retry-After, at most MAX_WAIT_S, times a jitter
        in [1, 1.5) so that clients told the same Retry-After do not come back at the same instant."""
        with self._lock:
            jitter = 1.0 + 0.5 * self._rng.random()
        return min(max(self.backoff_s * 2 ** attempt, retry_after or 0.0), MAX_WAIT_S) * jitter

    def close(self) -> None:
        self._http.close()


def parse_reply(data) -> Reply:
    """A chat completion's first choice -> Reply; anything else (no choices, a non-text content, text
    that is not valid Unicode) -> EndpointRequestError with reason endpoint:bad_reply."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        thought = message.get("reasoning_content") or message.get("reasoning") or ""
        finish = choice.get("finish_reason") or "stop"
        n = (data.get("usage") or {}).get("completion_tokens")
        if not (isinstance(content, str) and isinstance(thought, str) and isinstance(finish, str)
                and (n is None or isinstance(n, int))):
            raise TypeError("field types")
        content.encode("utf-8"), thought.encode("utf-8")  # a lone surrogate would fail the tokenizer later
    except (KeyError, IndexError, TypeError, AttributeError, UnicodeEncodeError) as e:
        raise EndpointRequestError(200, f"reply is not a chat completion ({type(e).__name__})",
                                   "endpoint:bad_reply") from None
    return Reply(content=content, finish_reason=finish, completion_tokens=n, reasoning=thought)


def retry_after_s(value: str | None) -> float | None:
    """`Retry-After` in seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def public_url(url: str) -> str:
    """The URL without any user:password part (errors and records are shared, secrets are not)."""
    from urllib.parse import urlsplit, urlunsplit

    p = urlsplit(url)
    return urlunsplit(p._replace(netloc=p.hostname + (f":{p.port}" if p.port else ""))) if p.hostname else url


def split_endpoints(endpoint: str | Sequence[str] | None) -> list[str]:
    """`--endpoint` given once or repeated, each possibly a comma-separated list -> the URLs, in order.
    A URL named twice is refused: its share of the work would silently double."""
    items = [endpoint] if isinstance(endpoint, str) else list(endpoint or [])
    urls = [u.strip() for item in items for u in item.split(",") if u.strip()]
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise ValueError(f"endpoint listed more than once: {', '.join(public_url(u) for u in twice)}")
    return urls


def check_served(endpoint: str, expected: str | Sequence[str], api_key: str | None = None,
                 timeout_s: float = 10.0) -> str:
    """GET `/v1/models` must list one of the `expected` ids (the prepared target's id, or the name it is
    served under), as is or as a path's tail (`--model-path /models/<id>`): answers of other weights
    would train a head for the wrong target. Anything else -> EndpointRefused naming the URL, the
    expected id and what is served. Returns the served id (the one to ask for)."""
    import httpx

    expected = [expected] if isinstance(expected, str) else list(expected)
    url = chat_url(endpoint).removesuffix("/chat/completions") + "/models"
    shown, want = public_url(url), " or ".join(repr(e) for e in expected)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EndpointRefused(f"endpoint {shown} unreachable: cannot check that it serves {want}: {e}") from e
    if r.status_code in (401, 403):
        raise EndpointRefused(f"endpoint {shown} refused the request ({r.status_code}): check the API key")
    try:
        served = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        served = None
    if served is None:
        raise EndpointRefused(f"endpoint {shown} lists no models (HTTP {r.status_code}): cannot check that it "
                              f"serves {want}")
    for e in expected:  # SGLang and vLLM name a model by the path they were given: /models/<target id>
        for s in served:
            if s == e or s.endswith("/" + e):
                return s
    raise EndpointRefused(f"endpoint {shown} serves {served}, not the expected model {want}: serve the prepared "
                          f"weights there (or name the id they are served under: --served-model)")


def spread(clients: Sequence, items: Sequence, work: Callable, emit: Callable, per_client: int,
           ahead: int | None = None) -> list[int]:
    """Data parallel over clients: `per_client` worker threads per client take items from one shared
    queue, `work(client, item)` each; `emit(result)` runs on the calling thread in the items' order
    (so the output does not depend on how many clients or which was faster). At most `ahead` items
    are taken and not yet emitted (default: twice the workers). A worker's exception stops the others
    (the requests in flight end first) and is raised here. Returns how many items each client did."""
    n, ahead = len(items), ahead or 2 * len(clients) * per_client
    cond = threading.Condition()
    results: dict[int, object] = {}
    state = {"next": 0, "emitted": 0, "stop": False, "error": None}
    done = [0] * len(clients)

    def worker(ci: int) -> None:
        while True:
            with cond:
                while not state["stop"] and state["next"] < n and state["next"] - state["emitted"] >= ahead:
                    cond.wait()
                if state["stop"] or state["next"] >= n:
                    return
                i = state["next"]
                state["next"] += 1
            try:
                out = work(clients[ci], items[i])
            except BaseException as e:  # noqa: BLE001 - raised on the calling thread
                with cond:
                    state["error"] = state["error"] or e
                    state["stop"] = True
                    cond.notify_all()
                return
            with cond:
                results[i] = out
                done[ci] += 1
                cond.notify_all()

    threads = [threading.Thread(target=worker, args=(ci,), daemon=True, name=f"endpoint-{ci}-{k}")
               for ci in range(len(clients)) for k in range(per_client)]
    for t in threads:
        t.start()
    try:
        for i in range(n):
            with cond:
                while i not in results and state["error"] is None:
                    cond.wait()
                if state["error"] is not None:
                    raise state["error"]
                out = results.pop(i)
            emit(out)
            with cond:
                state["emitted"] = i + 1
                cond.notify_all()
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        for t in threads:
            t.join()
    return done
