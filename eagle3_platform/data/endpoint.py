"""Client for any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM, the embedded server).

Transient failures (connection errors, timeouts, 429, 5xx) are retried with exponential backoff.
401, 403 and 404 say the endpoint refuses every request (key, URL or model name): `EndpointRefused`
stops the run, so nothing is rejected for it and a rerun with the right settings resumes. Any other
4xx, and a reply that is not a chat completion, is that request's fault: `EndpointRequestError`, so
the caller rejects that one conversation. Regeneration's endpoint back end (`regenerate.run_endpoint`)
drives it.

Reasoning models answer with `reasoning_content` beside `content` (SGLang and vLLM with a reasoning
parser; some servers call it `reasoning`): both are kept, and regeneration decides with its `reasoning`
setting whether the thinking is trained. `reasoning="drop"` also asks the server's template not to
think (`chat_template_kwargs: {"enable_thinking": false}`, honoured by Qwen3's template).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


class EndpointRequestError(ValueError):
    """The endpoint refused this request (4xx other than 429), or its reply is no chat completion:
    retrying will not help. `reason`: the rejection reason recorded for the conversation."""

    def __init__(self, status: int, detail: str, reason: str | None = None):
        super().__init__(f"endpoint answered {status}: {detail[:200]}")
        self.status = status
        self.reason = reason or f"endpoint:{status}"


class EndpointRefused(RuntimeError):
    """The endpoint refuses every request (401/403/404): a setting is wrong, not a record."""


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
                if last:
                    raise RuntimeError(f"endpoint {self.url} kept failing ({r.status_code}) after "
                                       f"{attempt + 1} tries")
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

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


def served_model(endpoint: str, fallback: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """First model id from `/v1/models` (vLLM insists on the served name); `fallback` if unavailable."""
    import httpx

    url = chat_url(endpoint).removesuffix("/chat/completions") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
        data = r.json().get("data") or []
        return data[0]["id"] if r.status_code == 200 and data else fallback
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return fallback
