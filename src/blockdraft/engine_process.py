"""An engine server's life cycle, for every stage that runs one: vLLM's (or SGLang's) OpenAI-compatible server in its
own Python (`make engine`), on a free loopback port, its health awaited, its log's tail in every error, stopped with
every process it started however the block that uses it ends (an error, Ctrl-C, SIGTERM), and killed by the kernel if
the command itself dies (`PR_SET_PDEATHSIG`). Eval serves drafters with it (`stages/eval/engine.py`); training reads
the target's features from it (`stages/train/engine_features.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from blockdraft.config import EvalConfig
from blockdraft.errors import EngineError, redact

SERVED_NAME = "target"  # the name the target is served under, so requests need not repeat its path
HEALTH_POLL_S = 0.5
REQUEST_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 6
CPU_KV_CACHE_GIB = "1"  # vLLM's CPU backend: its KV cache, unless VLLM_CPU_KVCACHE_SPACE says otherwise
_PR_SET_PDEATHSIG = 1


# How to get each engine's environment, for the one line when it is missing.
_INSTALL = {
    "vllm": "run `make engine` to build the engine's environment there (or set eval.engine_python to a Python "
            "that has vllm)",
    "sglang": "install sglang into a Python on a GPU machine (`pip install sglang`; its CPU build needs sgl-kernel "
              "built from source) and set eval.engine_python to it",
}


def engine_python(cfg: EvalConfig) -> Path:
    """The engine's interpreter, or EngineError saying how to get it when it is not there or cannot import the
    engine."""
    python = Path(cfg.engine_python)
    install = _INSTALL.get(cfg.engine, _INSTALL["vllm"])
    if not python.is_file():
        raise EngineError(f"eval.engine {cfg.engine}: no engine Python at {python}; {install}")
    if not _has_module(python, cfg.engine):
        raise EngineError(f"eval.engine {cfg.engine}: the engine Python at {python} has no {cfg.engine} module; "
                          f"{install}")
    return python


def _has_module(python: Path, module: str) -> bool:
    """Whether `python` finds `module`, without importing it (an engine's import takes seconds)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def server_argv(python: Path, engine: str, target: str, port: int, dtype: str, max_len: int | None,
                spec: dict[str, Any] | None, extra: Sequence[str], host: str = "127.0.0.1") -> list[str]:
    """The command line that serves `target` (with the drafter `spec`, vLLM's speculative config, or target-only) on
    `host`:`port`, with room for `max_len` tokens per sequence (None: what the target's config allows)."""
    if engine != "vllm":
        raise EngineError(f"eval.engine {engine!r} is not run by this version; use 'vllm'")
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name",
            SERVED_NAME, "--host", host, "--port", str(port), "--dtype", dtype, "--seed", "0"]
    if max_len is not None:
        argv += ["--max-model-len", str(max_len)]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if not cuda_here():
        # vLLM's CPU backend: no graph capture to wait for, and a memory fraction that fits beside the decode we run.
        argv += ["--enforce-eager", "--gpu-memory-utilization", "0.15"]
    return argv + list(extra)


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process, before exec: the kernel sends it SIGKILL when the command that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (and SIGHUP) raise KeyboardInterrupt while a server runs, so the `finally` that stops it runs too."""
    if not _main_thread():
        yield
        return
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Endpoint:
    """An engine's OpenAI-compatible server at `url`, started elsewhere: its requests, and what an error line says of
    it. `Server` is one this process started."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def exit_status(self) -> int | None:
        """The server process's exit status once it has exited; None while it runs, or when it is not ours to see."""
        return None

    def log_tail(self) -> str:
        return f"its log is the engine's own, where it was started ({redact(self.url)})"

    def wait_healthy(self, timeout_s: float, setting: str = "eval.engine_start_timeout_s") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (status := self.exit_status()) is not None:
                raise EngineError(f"the engine exited with status {status} while starting; {self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            time.sleep(HEALTH_POLL_S)
        raise EngineError(f"the engine at {redact(self.url)} did not answer /health within {timeout_s:.0f} s "
                          f"({setting}); {self.log_tail()}")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise EngineError(f"the engine answered {path} with HTTP {exc.code}: "
                              f"{redact(exc.read().decode(errors='replace')[:500])}") from None
        except (OSError, ValueError) as exc:
            raise EngineError(f"the engine did not answer {path} ({type(exc).__name__}: {redact(str(exc))}); "
                              f"{self.log_tail()}") from None

    def get_text(self, path: str) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as resp:
                return resp.read().decode()
        except OSError as exc:
            raise EngineError(f"the engine did not answer {path} ({type(exc).__name__}); {self.log_tail()}") from None


class Server(Endpoint):
    """One engine server process group on 127.0.0.1:`port`, started here, its output in `log`."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        super().__init__(f"http://127.0.0.1:{port}")
        self.argv, self.port, self.log = argv, port, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def log_tail(self) -> str:
        """The last lines of the server's output, redacted like every server text, as one line."""
        try:
            lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        tail = " | ".join(lines[-LOG_TAIL_LINES:])[-1500:]
        return f"its log ends: {redact(tail)}" if tail else "it wrote no log"

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after 15 s; returns when the server process is gone."""
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                self._reap_group()
                return

    def _reap_group(self) -> None:
        """The group's other processes (the engine's workers) get SIGKILL once the server itself has exited."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def server_env() -> dict[str, str]:
    """The environment of an engine server: ours, with the CPU backend's KV cache and engine-core settings defaulted."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    if not cuda_here():
        # On the CPU the engine core runs its model in its own process rather than in a separate worker: one request at
        # a time gains nothing from the worker, whose start (a process and its imports) is about a third of each
        # server's start (bench/engine_start.py measures both ways).
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


@contextlib.contextmanager
def serving_together(argvs: dict[str, list[str]], workdir: Path, cfg: EvalConfig,
                     env: dict[str, str] | None = None) -> Iterator[dict[str, Server]]:
    """A healthy server per name for the duration of the block, all launched before any is waited for (a start is
    mostly one core's imports and loading, so on several cores they overlap); every one stopped, with every process it
    started, however the block ends. `env`: the servers' environment (default `server_env()`)."""
    env = env if env is not None else server_env()
    with _terminate_as_interrupt(), contextlib.ExitStack() as running:
        servers: dict[str, Server] = {}
        for name, argv in argvs.items():
            servers[name] = Server(argv, int(argv[argv.index("--port") + 1]), workdir / f"engine-{name}.log", env)
            running.callback(servers[name].stop)
        for server in servers.values():
            server.wait_healthy(cfg.engine_start_timeout_s)
        yield servers


@contextlib.contextmanager
def serving(argv: list[str], workdir: Path, name: str, cfg: EvalConfig,
            env: dict[str, str] | None = None) -> Iterator[Server]:
    """A healthy server for the duration of the block; stopped (with every process it started) however the block
    ends. `env`: as `serving_together`'s."""
    with serving_together({name: argv}, workdir, cfg, env) as servers:
        yield servers[name]


__all__ = ["SERVED_NAME", "Endpoint", "Server", "cuda_here", "engine_python", "free_port", "server_argv", "server_env",
           "serving", "serving_together"]
