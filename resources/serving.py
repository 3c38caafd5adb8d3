"""The `serving` resource: how the draft head is deployed.

mode "embedded" runs the library's CPU OpenAI-compatible server (`eagle3 serve`); "sglang" launches
SGLang with EAGLE-3 speculative settings (GPU); "auto" picks SGLang when a GPU and the SGLang
environment are present. SGLang runs from its own environment (scripts/sglang_env.sh), named by
`sglang_python`. GPU detection and the speculative-settings merge live in `eagle3_platform.serve.sglang`.
The benchmark runs the baseline and the EAGLE-3 server side by side (its cells alternate between
them), started one after the other, each SGLang server held to `bench_mem_fraction_static` of the GPU
memory so that both fit on the same GPUs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

# Two SGLang servers on the same GPUs: the static pools must leave room for activations and CUDA graphs.
MAX_SHARED_MEM_FRACTION = 0.45


class ServingResource(ConfigurableResource):
    mode: Literal["auto", "embedded", "sglang"] = "auto"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port chosen at deploy time
    baseline_port: int = 0
    api_key: str | None = None
    # SGLang speculative settings: set all three or none (docs/ARCHITECTURE.md §6); None = the spec
    # preset's values.
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    keep_running: bool = False  # leave the endpoint up after `deployment` materializes
    startup_timeout_s: float = 300.0
    bench_duration_s: int | None = None  # seconds per (endpoint, concurrency) cell; None = bench preset
    # SGLang (docs/PRODUCTION.md). The SGLang environment's interpreter; None: <project>/.venv-sglang/bin/python.
    sglang_python: str | None = None
    tp_size: int = Field(default=1, ge=1)          # --tp-size: GPUs per server (tensor parallel)
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)  # the deployment alone; None: SGLang's
    bench_mem_fraction_static: float = Field(default=0.4, gt=0, le=MAX_SHARED_MEM_FRACTION)  # each bench server
    context_length: int | None = Field(default=None, ge=1)   # None: the model config's
    dtype: str | None = None                       # --dtype (auto, bfloat16, float16); None: SGLang's auto
    spec_v2: bool | None = None  # SGLANG_ENABLE_SPEC_V2 (overlap scheduler; chain drafting only); None: SGLang's
    extra_args: list[str] = []                     # appended verbatim (flags the launcher owns are refused)
    # The embedded server's `--device` (auto | cpu | cuda | cuda:N); None: the serve preset's (auto =
    # CUDA where torch sees a GPU). A device asked for and absent fails the server at startup.
    device: str | None = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        from eagle3_platform.serve.sglang import sglang_available

        return "sglang" if sglang_available(self.sglang_interpreter()) else "embedded"

    def sglang_interpreter(self) -> str:
        from resources.storage import PROJECT_ROOT

        return self.sglang_python or str(Path(PROJECT_ROOT) / ".venv-sglang" / "bin" / "python")

    def spec_name(self, preset: str) -> str:
        """The speculative-settings preset (chain | tree | tiny) the platform preset deploys with."""
        from eagle3_platform.config import SPEC_FOR_PRESET

        return SPEC_FOR_PRESET[preset]

    def launch(self, target_dir, draft_dir=None, log_path=None, preset: str = "demo", port=None,
               compute: dict | None = None, shared: bool = False, registry=None, persistent: bool = False,
               role: str = "server"):
        """Start an endpoint (draft_dir None = the baseline); returns a handle with .url and .stop().
        compute: the preset's compute overrides (dtype, torch_threads) for the embedded server.
        shared: one of the benchmark's two servers on the same GPUs (bench_mem_fraction_static).
        registry (serve.launch.ServerRegistry): records it (pid, role) after stopping the leftovers
        recorded there; persistent: it outlives the step (else it dies with it)."""
        mode = self.resolved_mode()
        if mode == "embedded":
            compute = compute or {}
            flags = ["--preset", preset] + (["--dtype", compute["dtype"]] if "dtype" in compute else [])
            flags += _thread_flags(compute.get("torch_threads"))
            flags += ["--device", self.device] if self.device else []
            from eagle3_platform.serve.launch import start_embedded_server

            return start_embedded_server(target_dir, draft_dir, host=self.host,
                                         port=self.port if port is None else port,
                                         api_key=self.api_key, spec=self.spec_name(preset),
                                         log_path=log_path, timeout=self.startup_timeout_s,
                                         extra_args=flags, registry=registry, persistent=persistent, role=role)
        from eagle3_platform.serve.sglang import SGLangServer

        cfg = self.sglang_config(target_dir, draft_dir, preset, port, shared)
        python = self.sglang_interpreter()
        if not Path(python).is_file():
            raise FileNotFoundError(f"no SGLang environment at {python}: build it with bash scripts/sglang_env.sh "
                                    "or set the serving resource's sglang_python (EAGLE3_SGLANG_PYTHON)")
        reaped = registry.reap() if registry is not None else []
        server = SGLangServer(cfg, log_path=log_path, python=python, api_key=self.api_key,
                              persistent=persistent).start(self.startup_timeout_s)
        if registry is not None:
            registry.record(server.pid, url=server.url, role=role, persistent=persistent, log=log_path)
        server.reaped = reaped
        return server

    def sglang_config(self, target_dir, draft_dir, preset: str, port=None, shared: bool = False):
        """SGLang launch settings: the three speculative ints from this resource, else from the
        preset's spec config; none of them for the baseline (no draft); the server settings as set
        here (shared: the benchmark's memory fraction)."""
        from eagle3_platform.config import preset as platform_preset
        from eagle3_platform.serve.sglang import SGLangConfig, free_port

        port = self.port if port is None else port
        return SGLangConfig.from_spec(str(target_dir), str(draft_dir) if draft_dir else None,
                                      platform_preset(preset).spec, self.num_steps, self.eagle_topk,
                                      self.num_draft_tokens, host=self.host, port=port or free_port(self.host),
                                      mem_fraction_static=self.bench_mem_fraction_static if shared
                                      else self.mem_fraction_static, tp_size=self.tp_size,
                                      context_length=self.context_length, dtype=self.dtype,
                                      spec_v2=self.spec_v2 if draft_dir else None, extra_args=tuple(self.extra_args))


def _thread_flags(n: int | None) -> list[str]:
    """A preset's torch_threads override for `eagle3 serve --threads`: n > 0 pins every thread count
    alike (a shared box); 0 gives the target and the head every core; None keeps the serve preset's."""
    return [] if n is None else ["--threads", str(n)]
