"""A deterministic stand-in engine for server/bench tests (no torch, no model).

`FakeEngine` implements the SpecEngine surface the server uses: `.batch()` (open / prefill / step /
close, see spec/batch.py). `python -m eagle3_platform.testing.serve` serves it
over HTTP exactly like `eagle3 serve` (same app, same shutdown path) so subprocess tests are fast;
`ThreadServer` serves any app in-process on a real socket with the same uvicorn settings.
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path
from typing import Sequence

from eagle3_platform.draft.metrics import acceptance_length


class FakeRequest:
    """Emits text token ids cycling through the engine's `vocab_ids`: one from the "prefill", then
    `chunk` ids per "verify step" (SpecEngine's accounting: τ = (generated - 1) / verify_steps)."""

    def __init__(self, engine: "FakeEngine", input_ids, max_new_tokens, temperature, stop, seed):
        engine.calls.append({"n_prompt": len(input_ids), "max_new_tokens": max_new_tokens,
                             "temperature": temperature, "stop": tuple(stop), "seed": seed})
        rng = random.Random(seed if seed is not None else sum(input_ids))
        self.engine, self.ids, self.max_new = engine, list(input_ids), max_new_tokens
        self.start = rng.randrange(len(engine.vocab_ids)) if temperature > 0 else len(input_ids)
        self.produced, self.steps, self.last_accepted = 0, -1, 0  # the first chunk is the prefill's
        self.last_drafted = 0
        self.prefilled = 0

    @property
    def done(self) -> bool:
        return self.produced >= self.max_new

    def next_chunk(self) -> list[int]:
        e = self.engine
        if e.fail_after is not None and self.produced >= e.fail_after:
            raise RuntimeError("fake engine failure")
        n = min(e.chunk if self.produced else 1, self.max_new - self.produced)
        out = [e.vocab_ids[(self.start + self.produced + i) % len(e.vocab_ids)] for i in range(n)]
        self.produced, self.steps, self.last_accepted = self.produced + n, self.steps + 1, n - 1
        self.last_drafted = n - 1  # a fake draft: exactly what is accepted
        if e.delay_s:
            time.sleep(e.delay_s)
        return out

    def stats(self) -> dict:
        steps = max(self.steps, 0)
        return {"generated_tokens": self.produced, "verify_steps": steps,
                "acceptance_length": acceptance_length(max(self.produced - 1, 0), steps),
                "finish_reason": "length" if self.done else None}


class FakeBatch:
    """The Batch surface the server's worker drives (open / prefill / step / close)."""

    def __init__(self, engine: "FakeEngine"):
        self.engine, self.rows = engine, []

    def open(self, input_ids, max_new_tokens, temperature=0.0, stop=(), seed=None) -> FakeRequest:
        return FakeRequest(self.engine, input_ids, max_new_tokens, temperature, stop, seed)

    def prefill(self, r: FakeRequest, max_tokens=None, join: bool = True):
        start = r.prefilled
        r.prefilled = len(r.ids) if max_tokens is None else min(len(r.ids), r.prefilled + max_tokens)
        self.engine.events.append(("prefill", r.prefilled - start))
        if r.prefilled < len(r.ids):
            return None
        if join:
            self.rows.append(r)
        return r.next_chunk()

    def step(self, max_draft_tokens=None, prompts=()):
        """The rows' chunks, then those of the prompts (request, n) done in this step (they join after
        it). As the real Batch: if a riding prompt's part fails, every rider is given up
        (`failed_prompts`) and the rows step alone."""
        if not self.rows:
            raise ValueError("a step needs running rows")
        rows, joined = list(self.rows), []
        self.failed_prompts, self.prompt_error = [], None
        try:
            for r, n in prompts:
                if (out := self.prefill(r, n, join=False)) is not None:
                    joined.append((r, out))
        except Exception as e:
            self.failed_prompts, self.prompt_error, joined = [r for r, _ in prompts], e, []
        self.engine.events.append(("step", len(rows)))
        out = [(r, r.next_chunk()) for r in rows]
        self.rows += [r for r, _ in joined]
        return out + joined

    def close(self, r: FakeRequest) -> dict:
        if r in self.rows:
            self.rows.remove(r)
        return r.stats()


class FakeEngine:
    def __init__(self, vocab_ids: Sequence[int], eos_id: int | None = None, chunk: int = 2,
                 delay_s: float = 0.0, fail_after: int | None = None):
        self.vocab_ids = list(vocab_ids)
        self.eos_id = eos_id
        self.chunk = chunk
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.calls: list[dict] = []
        # ("prefill", prompt tokens) / ("step", running rows), in order: tests of the scheduling
        self.events: list[tuple[str, int]] = []

    def batch(self) -> FakeBatch:
        return FakeBatch(self)


class ThreadServer:
    """An app served by uvicorn in a background thread with the production settings
    (server.uvicorn_config of the app's ServeConfig) on a free loopback port; no signal handlers
    (not the main thread). `with ThreadServer(app) as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, app):
        import threading

        import uvicorn

        from eagle3_platform.serve.server import bind_socket, uvicorn_config
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, app.state.service.cfg, "warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> "ThreadServer":
        from eagle3_platform.serve.launch import wait_healthy

        self.thread.start()
        wait_healthy(self.url, None, 20, None)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def fake_app(tokenizer, engine=None, api_key=None, model_name: str = "fake-model", **cfg):
    """(app, engine): the real server app over a FakeEngine (3 word tokens a step) with small test
    bounds; cfg overrides ServeConfig fields. Host "testserver" is what starlette's TestClient sends."""
    from eagle3_platform.serve.config import ServeConfig
    from eagle3_platform.serve.server import build_app

    engine = engine or FakeEngine(word_token_ids(tokenizer), chunk=3)
    base = ServeConfig(max_tokens=40, default_max_tokens=12, max_queue=16, max_body_bytes=20_000,
                       allowed_hosts=("testserver",))
    app = build_app(engine, tokenizer, base.with_(**cfg), model_name=model_name, context_length=256,
                    api_key=api_key)
    return app, engine


def word_token_ids(tokenizer, text: str = "the quick brown fox jumps over the lazy dog ") -> list[int]:
    """Ids whose decoding is plain text, so streamed output is readable and stop strings work."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def random_export(target_dir, out_dir, draft_vocab_size: int = 64, seed: int = 0) -> Path:
    """An untrained (random) EAGLE-3 export for a prepared target: exercises the real drafting and
    verification path end to end (greedy output must still equal the target's; τ will be ~1)."""
    import torch

    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
    from eagle3_platform.draft.train import save_draft_dir
    from eagle3_platform.draft.vocab import build_vocab
    from eagle3_platform.model.target import read_meta

    out_dir = Path(out_dir)
    hf = target_hf_config(target_dir)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d, _ = build_vocab(torch.randint(0, 50, (hf["vocab_size"],), generator=g),
                              hf["vocab_size"], draft_vocab_size)
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(hf, draft_vocab_size, read_meta(target_dir)["capture_layer_ids"])
    draft = build_draft(target_dir, cfg, True, d2t, t2d)
    draft_dir = save_draft_dir(out_dir.with_name(out_dir.name + "-train"), draft,
                               {"target": read_meta(target_dir)})
    export_draft(draft_dir, out_dir, dtype="float32")
    return out_dir


def main(argv=None) -> int:
    import os

    from eagle3_platform.model.target import tiny_tokenizer
    from eagle3_platform.serve.config import PRESETS
    from eagle3_platform.serve.server import API_KEY_ENV, build_app, run_server

    ap = argparse.ArgumentParser(description="serve the fake engine (tests)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--delay-s", type=float, default=0.01)
    ap.add_argument("--chunk", type=int, default=2)
    ap.add_argument("--shutdown-grace-s", type=float, default=5.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    tok = tiny_tokenizer()
    engine = FakeEngine(word_token_ids(tok), chunk=a.chunk, delay_s=a.delay_s)
    cfg = PRESETS["tiny"].with_(port=a.port, shutdown_grace_s=a.shutdown_grace_s)
    app = build_app(engine, tok, cfg, model_name="fake", context_length=512,
                    api_key=os.environ.get(API_KEY_ENV), info={"draft": True, "spec": "fake"})
    run_server(app, cfg, ready_file=a.ready_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
