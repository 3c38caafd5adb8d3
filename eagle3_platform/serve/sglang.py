"""SGLang launcher: command builder, start/stop, /health, /server_info (docs/ARCHITECTURE.md §6).

Flag names follow sgl-project/sglang `python/sglang/srt/server_args.py` (`model_path`,
`speculative_algorithm`, `speculative_draft_model_path`, `speculative_num_steps`,
`speculative_eagle_topk`, `speculative_num_draft_tokens`, `mem_fraction_static`, `tp_size`,
`context_length`, `dtype`, `host`, `port`; dataclass field → `--field-name`). The acceptance length
is on `/server_info` (older releases: `/get_server_info`) as
`internal_states[i].avg_spec_accept_length` (per DP rank) or, in older releases, top-level
`avg_spec_accept_length`: a cumulative average since launch.
SGLang's overlap scheduler for speculative decoding ("spec v2", env SGLANG_ENABLE_SPEC_V2) requires
`--speculative-eagle-topk 1` (chain drafting).
SGLang runs from an environment of its own (scripts/sglang_env.sh: it pins torch/transformers other
than this project's), so the command starts with that environment's interpreter, not this one's.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eagle3_platform.serve.launch import die_with_parent, log_tail, stop_process, wait_healthy

LAUNCH_MODULE = "sglang.launch_server"
ALGORITHM = "EAGLE3"
SPEC_V2_ENV = "SGLANG_ENABLE_SPEC_V2"
HEALTH_TIMEOUT_S = 900.0   # first launch compiles kernels / captures CUDA graphs
# Flags this builder owns; passing them again through extra_args would be ambiguous.
OWNED_FLAGS = {"--model-path", "--model", "--speculative-algorithm", "--speculative-algo",
               "--speculative-draft-model-path", "--speculative-draft", "--speculative-num-steps",
               "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--host", "--port",
               "--mem-fraction-static", "--tp-size", "--tp", "--tensor-parallel-size", "--context-length",
               "--dtype", "--api-key"}
DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


@dataclass(frozen=True)
class SGLangConfig:
    model_path: str
    draft_path: str | None = None          # None = plain target serving (the baseline)
    num_steps: int | None = None           # the three speculative ints: all or none
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float | None = None  # None: SGLang's own (most of the GPU: one server alone)
    tp_size: int = 1                       # tensor-parallel GPUs of one server
    context_length: int | None = None      # None: the model config's
    dtype: str | None = None               # None: SGLang's "auto"
    spec_v2: bool | None = None            # overlap scheduler for spec decoding (True: topk 1); None: SGLang's
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        ints = (self.num_steps, self.eagle_topk, self.num_draft_tokens)
        given = [v is not None for v in ints]
        if any(given) and not all(given):
            raise ValueError("set all three of num_steps, eagle_topk, num_draft_tokens or none "
                             f"(got steps={self.num_steps}, topk={self.eagle_topk}, "
                             f"draft_tokens={self.num_draft_tokens})")
        if all(given):
            self._check_tree()
        if self.tp_size < 1 or (self.context_length is not None and self.context_length < 1):
            raise ValueError(f"need tp_size >= 1 and context_length >= 1 (got {self.tp_size}, {self.context_length})")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: SGLang takes one of {', '.join(DTYPES)}")
        if self.spec_v2 and self.eagle_topk != 1:
            raise ValueError("SGLang's overlap scheduler for speculative decoding (spec v2) needs "
                             "eagle_topk=1 (chain drafting)")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        clash = OWNED_FLAGS & {a.split("=")[0] for a in self.extra_args}
        if clash:
            raise ValueError(f"extra_args repeat flags set by SGLangConfig: {sorted(clash)}")

    def _check_tree(self) -> None:
        if self.draft_path is None:
            raise ValueError("speculative settings need a draft model path")
        s, k, n = self.num_steps, self.eagle_topk, self.num_draft_tokens
        if s < 1 or k < 1 or n < 2:
            raise ValueError(f"need num_steps>=1, eagle_topk>=1, num_draft_tokens>=2 (got {s},{k},{n})")
        if k == 1 and n != s + 1:
            raise ValueError(f"a chain (topk 1) of {s} steps verifies {s + 1} draft tokens, not {n}")
        if n > 1 + k * s:
            raise ValueError(f"num_draft_tokens {n} exceeds the tree size 1 + topk*steps = {1 + k * s}")

    @classmethod
    def from_spec(cls, model_path: str, draft_path: str | None, spec, num_steps: int | None = None,
                  eagle_topk: int | None = None, num_draft_tokens: int | None = None, **kw) -> "SGLangConfig":
        """THE speculative-settings merge: the three ints given (all or none), else the engine's
        SpecConfig's, so the embedded and the SGLang deployment draft alike. The baseline (no draft)
        gets none."""
        ints = (num_steps, eagle_topk, num_draft_tokens)
        if draft_path is None:
            ints = (None, None, None)
        elif all(v is None for v in ints) and spec.speculative:
            ints = (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)
        return cls(model_path, draft_path, *ints, **kw)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def build_command(self, python: str | None = None) -> list[str]:
        cmd = [python or sys.executable, "-m", LAUNCH_MODULE, "--model-path", str(self.model_path)]
        if self.draft_path is not None:
            cmd += ["--speculative-algorithm", ALGORITHM,
                    "--speculative-draft-model-path", str(self.draft_path)]
        if self.num_steps is not None:
            cmd += ["--speculative-num-steps", str(self.num_steps),
                    "--speculative-eagle-topk", str(self.eagle_topk),
                    "--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        cmd += ["--host", self.host, "--port", str(self.port)]
        for flag, value in (("--mem-fraction-static", self.mem_fraction_static),
                            ("--context-length", self.context_length), ("--dtype", self.dtype)):
            cmd += [flag, str(value)] if value is not None else []
        cmd += ["--tp-size", str(self.tp_size)] if self.tp_size > 1 else []
        return cmd + list(self.extra_args)

    def env(self) -> dict:
        return {} if self.spec_v2 is None else {SPEC_V2_ENV: str(self.spec_v2)}


def sglang_available(python: str | None = None) -> bool:
    """SGLang serves on GPUs: CUDA visible to torch and SGLang there (`python`: the interpreter of the
    SGLang environment exists; None: the package importable in this one)."""
    if python is not None and not os.access(python, os.X_OK):
        return False
    if python is None and importlib.util.find_spec("sglang") is None:
        return False
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def spec_accept_length(info: dict) -> float | None:
    """`avg_spec_accept_length` from a /server_info body (top-level or mean over DP ranks)."""
    if info.get("avg_spec_accept_length") is not None:
        return float(info["avg_spec_accept_length"])
    vals = [s["avg_spec_accept_length"] for s in info.get("internal_states") or []
            if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass
class SGLangServer:
    cfg: SGLangConfig
    log_path: Path | None = None
    python: str | None = None
    api_key: str | None = None
    persistent: bool = False  # outlives its starter; a transient server dies with it (no orphan)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.cfg.url

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def command(self) -> list[str]:
        """The launch argv; the api key, when set, travels last."""
        return self.cfg.build_command(self.python) + (["--api-key", self.api_key] if self.api_key else [])

    def describe(self) -> str:
        """The launch command as a shell line for records and logs (the api key masked)."""
        cmd = self.cfg.build_command(self.python) + (["--api-key", "REDACTED"] if self.api_key else [])
        env = " ".join(f"{k}={v}" for k, v in self.cfg.env().items())
        return (env + " " if env else "") + shlex.join(cmd)

    def start(self, timeout: float = HEALTH_TIMEOUT_S) -> "SGLangServer":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"SGLang already running (pid {self.proc.pid})")
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="sglang-")) / "server.log"
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.cfg.env()}, start_new_session=True,
                                         preexec_fn=None if self.persistent else die_with_parent())
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        wait_healthy(self.url, self.proc, timeout, self.log_path, "SGLang")

    def server_info(self) -> dict:
        for path in ("/server_info", "/get_server_info"):
            r = httpx.get(self.url + path, headers=self.headers(), timeout=10)
            if r.status_code != 404:
                r.raise_for_status()
                return r.json()
        raise RuntimeError(f"{self.url} has neither /server_info nor /get_server_info")

    def accept_length(self) -> float | None:
        return spec_accept_length(self.server_info())

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        return stop_process(self.proc, timeout)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log(self) -> str:
        return log_tail(self.log_path) if self.log_path else ""


def free_port(host: str = "127.0.0.1") -> int:
    """SGLang cannot bind port 0 and report it, so a free port is picked here (small race)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_sglang_server(target_dir, draft_dir=None, host: str = "127.0.0.1", port: int = 0,
                        api_key: str | None = None, num_steps: int | None = None,
                        eagle_topk: int | None = None, num_draft_tokens: int | None = None,
                        log_path=None, timeout: float = HEALTH_TIMEOUT_S, spec: str = "chain",
                        mem_fraction_static: float | None = None,
                        extra_args: tuple[str, ...] = ()) -> SGLangServer:
    """Launch SGLang on a prepared target (+ EAGLE-3 export) and wait for /health.
    With a draft and none of the three speculative ints, the engine preset `spec` supplies them,
    so SGLang drafts exactly like the embedded engine."""
    from eagle3_platform.spec.config import get_preset

    draft = None if draft_dir is None else str(draft_dir)
    cfg = SGLangConfig.from_spec(str(target_dir), draft, get_preset(spec), num_steps, eagle_topk, num_draft_tokens,
                                 host=host, port=port or free_port(host), mem_fraction_static=mem_fraction_static,
                                 extra_args=tuple(extra_args))
    return SGLangServer(cfg, log_path=log_path, api_key=api_key).start(timeout)
