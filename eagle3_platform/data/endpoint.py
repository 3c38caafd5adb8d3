"""Client for any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM, the embedded server).

Transient failures (connection errors, timeouts, 429, 5xx) are retried with exponential backoff; any
other 4xx is the request's fault and raised as `EndpointRequestError` so the caller can reject that one
conversation. Regeneration's endpoint back end (`regenerate.run_endpoint`) drives it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


class EndpointRequestError(ValueError):
    """The endpoint refused this request (4xx other than 429): retrying will not help."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"endpoint answered {status}: {detail[:200]}")
        self.status = status


@dataclass(frozen=True)
class Reply:
    content: str
    finish_reason: str
    completion_tokens: int | None


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
             seed: int | None) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "stream": False}
        if seed is not None:
            body["seed"] = seed
        data = self._post(body)
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        return Reply(content=choice["message"].get("content") or "",
                     finish_reason=choice.get("finish_reason") or "stop",
                     completion_tokens=usage.get("completion_tokens"))

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
                    return r.json()
                if r.status_code != 429 and r.status_code < 500:
                    raise EndpointRequestError(r.status_code, r.text)
                if last:
                    raise RuntimeError(f"endpoint {self.url} kept failing ({r.status_code}) after "
                                       f"{attempt + 1} tries")
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._http.close()


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
