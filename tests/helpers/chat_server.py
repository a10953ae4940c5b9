"""A small OpenAI-compatible chat endpoint for a local Hugging Face model, on 127.0.0.1 only.

It exists so that the `openai` engine is tested over real HTTP with the tiny target. Production generation uses
vLLM or SGLang, which batch requests, page the KV cache and scale across GPUs; this server answers one request at a
time with `transformers` greedy generation.

    python tests/helpers/chat_server.py MODEL_DIR [--port 0] [--faults 503,hold,ok] [--request-log FILE] [--api-key KEY]

Endpoints: `POST /v1/chat/completions` (messages, max_tokens, temperature, top_p, chat_template_kwargs; answers with
`message.reasoning_content`, `prompt_token_ids` and `choices[0].token_ids` like vLLM with `return_token_ids`),
`GET /v1/models`, `GET /health`. It prints `listening on http://127.0.0.1:PORT` once it accepts connections.

Fault injection, for tests: `--faults 503,503,hold,ok` scripts the answers to the first chat requests in arrival order
(a status is answered as an error; `hold` never answers, so the client's timeout fires for certain, and the connection
is closed unanswered when the server stops; `ok` serves). Every chat request is recorded as two events (`events()`, and
JSON lines in `request_log`): {"request_id" (the X-Request-Id header), "arrived": its scripted answer, "sampling": the
body's max_tokens, temperature, top_p, chat_template_kwargs and tools as sent} on arrival and {"request_id", "status"}
once answered (a held request is never answered). An answer's tool calls go back in `message.tool_calls`.

`--api-key KEY` makes every request without `Authorization: Bearer KEY` answer 401 with a message that echoes the key it
was sent, in full, as some servers do: the worst case for a client that must keep keys out of what it stores and prints.
In process, `ChatServer(..., echo=...)` echoes it in other forms servers use: `base64`-encoded, or its `first10`
characters, in words that match no credential shape, so only the client's knowledge of its own key can catch them.

In process, `ChatServer` serves any `Chat` in a thread (`with ChatServer(chat, faults=...) as server:`); as a child
process, `EndpointProcess` starts this module and waits until it listens.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from blockdraft.data.chat import Completion, Prompt
from blockdraft.decode.batch_generate import generate_completions


@dataclass
class FaultPlan:
    """The answers to the first chat requests, in arrival order: "503" (any status: answered with it), "hold" (never
    answered; released, unanswered, when `release` is set) or "ok"; requests after the script are served normally."""

    script: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def parse(cls, script: str) -> FaultPlan:
        steps = [s.strip() for s in script.split(",") if s.strip()]
        for step in steps:
            if step not in ("ok", "hold") and not (step.isdigit() and 400 <= int(step) <= 599):
                raise ValueError(f"fault step {step!r}: use ok, hold or an HTTP status 400-599")
        return cls(steps)


class Chat(Protocol):
    """What the endpoint serves: a model `name` (listed by /v1/models) and one completion at a time.

    `complete` raises for a prompt the model cannot take (a template error): the endpoint answers 400 with the message.
    """

    name: str

    def complete(self, prompt: Prompt, max_tokens: int, temperature: float) -> Completion: ...


class ChatModel:
    """A local transformers model behind the endpoint; one generation at a time (the lock), greedy unless
    temperature > 0."""

    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        import torch  # heavy: only the serving process needs it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = Path(model_dir).name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self._lock = threading.Lock()

    def complete(self, prompt: Prompt, max_tokens: int, temperature: float) -> Completion:
        with self._lock:
            return generate_completions(self.model, self.tokenizer, [prompt], max_tokens, temperature,
                                        prompt.settings.get("top_p"))[0]


SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "chat_template_kwargs", "tools")


def parse_request(body: Any, request_id: str) -> tuple[Prompt, int, float]:
    """(prompt, max_tokens, temperature) of a chat-completions body, the prompt's settings holding its top_p and
    reasoning effort; ValueError when it is not one."""
    if not isinstance(body, dict):
        raise ValueError("the body is not a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("'messages' must be a non-empty list of message objects")
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking")
    max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
    settings = {"top_p": float(body["top_p"])} if body.get("top_p") is not None else {}
    if kwargs.get("reasoning_effort") is not None:
        settings["reasoning_effort"] = kwargs["reasoning_effort"]
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    prompt = Prompt(request_id, messages, thinking if isinstance(thinking, bool) else None, settings, tools=tools)
    return prompt, max_tokens, float(body.get("temperature") or 0.0)


def chat_response(model: str, request_id: str, done: Completion) -> dict[str, Any]:
    """The answer's body, shaped like vLLM's with `return_token_ids`."""
    prompt_ids, completion_ids = done.prompt_token_ids or [], done.completion_token_ids or []
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "prompt_token_ids": prompt_ids,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": done.content, "reasoning_content": done.reasoning_content,
                        **({"tool_calls": done.tool_calls} if done.tool_calls else {})},
            "finish_reason": done.finish_reason,
            "token_ids": completion_ids,
        }],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                  "total_tokens": len(prompt_ids) + len(completion_ids)},
    }


class RequestEvents:
    """The chat requests an endpoint saw, from its events (see the module docstring)."""

    def events(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def arrived(self) -> list[str]:
        """Request ids in arrival order."""
        return [e["request_id"] for e in self.events() if "arrived" in e]

    def answered(self, status: int = 200) -> list[str]:
        """Request ids answered with `status`, in the order they were answered."""
        return [e["request_id"] for e in self.events() if e.get("status") == status]


class _Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the request events are the record
        return

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout); nothing to answer

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message,
                                      "type": "invalid_request_error" if status < 500 else "server_error",
                                      "code": status}})

    def _refused(self) -> bool:
        """Answer 401 echoing the sent key when the server wants another one (see the module docstring)."""
        wanted = self.server.api_key
        sent = self.headers.get("Authorization") or ""
        if wanted is None or sent == f"Bearer {wanted}":
            return False
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        key = sent.removeprefix("Bearer ")
        message = {
            "key": f"Incorrect API key provided: {key}. Header sent: Authorization: {sent}",
            "base64": f"Credential {base64.b64encode(key.encode()).decode()} is not on file",
            "first10": f"Credential starting {key[:10]}... is not on file",
        }[self.server.echo]
        self._send(401, {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}})
        return True

    def do_GET(self) -> None:
        if self._refused():
            return
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list",
                             "data": [{"id": self.server.chat.name, "object": "model", "owned_by": "blockdraft"}]})
        elif self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self._refused():
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, f"no route {self.path}")
            return
        request_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        fault = self.server.next_fault()
        try:
            body = json.loads(raw)
            sampling = {key: body[key] for key in SAMPLING_KEYS if key in body} if isinstance(body, dict) else {}
        except ValueError:
            sampling = {}
        self.server.log_event({"request_id": request_id, "arrived": fault, "sampling": sampling})
        if fault == "hold":
            self.server.faults.release.wait()
            self.close_connection = True  # unanswered: the client is long gone
            return
        status = self._answer(raw, request_id, fault)
        self.server.log_event({"request_id": request_id, "status": status})

    def _answer(self, raw: bytes, request_id: str, fault: str) -> int:
        if fault.isdigit():
            self._error(int(fault), "injected failure")
            return int(fault)
        try:
            done = self.server.chat.complete(*parse_request(json.loads(raw), request_id))
        except Exception as exc:  # the prompt's fault (bad JSON, template error): a 400 with the reason, like vLLM
            self._error(400, f"{type(exc).__name__}: {exc}")
            return 400
        self._send(200, chat_response(self.server.chat.name, request_id, done))
        return 200


class ChatServer(ThreadingHTTPServer, RequestEvents):
    """The endpoint on 127.0.0.1:`port` (0 picks a free one). As a context manager it serves in a thread, and on exit
    releases held requests and closes."""

    daemon_threads = True

    def __init__(self, chat: Chat, port: int = 0, faults: FaultPlan | None = None, request_log: str | None = None,
                 api_key: str | None = None, echo: Literal["key", "base64", "first10"] = "key") -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.chat = chat
        self.api_key = api_key
        self.echo = echo
        self.faults = faults or FaultPlan()
        self._request_log = request_log
        self._events: list[dict[str, Any]] = []
        self._count = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def next_fault(self) -> str:
        with self._lock:
            n = self._count
            self._count += 1
        return self.faults.script[n] if n < len(self.faults.script) else "ok"

    def log_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)
            if self._request_log is not None:
                with open(self._request_log, "a") as f:
                    f.write(json.dumps(event) + "\n")

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def __enter__(self) -> ChatServer:
        threading.Thread(target=self.serve_forever, name="chat-server", daemon=True).start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.faults.release.set()
        self.shutdown()
        self.server_close()


class EndpointProcess(RequestEvents):
    """This module serving `model_dir` as a child process; `url` is its /v1 base, its events come from `request_log`."""

    def __init__(self, model_dir: str | Path, request_log: Path, faults: str = "") -> None:
        self.request_log = request_log
        cmd = [sys.executable, __file__, str(model_dir), "--port", "0",
               "--request-log", str(request_log), "--faults", faults]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the server listens (or dies)
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"the endpoint did not start: {line!r}")
        self.url = line.split()[-1] + "/v1"

    def events(self) -> list[dict[str, Any]]:
        if not self.request_log.exists():
            return []
        return [json.loads(x) for x in self.request_log.read_text().splitlines() if x.strip()]

    def kill(self) -> None:
        """SIGKILL: the endpoint dies mid-request, as a crashed server does."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> EndpointProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenAI-compatible chat endpoint for a local HF model (blockdraft's "
                                                 "tests; use vLLM or SGLang in production).")
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest for tiny models on a busy machine)")
    parser.add_argument("--faults", default="",
                        help="answers to the first chat requests: comma-separated ok, hold or an HTTP status")
    parser.add_argument("--request-log", default=None)
    parser.add_argument("--api-key", default=None,
                        help="answer 401, echoing the key sent, to requests without this key")
    args = parser.parse_args()

    import torch  # heavy: only the serving process needs it

    try:
        faults = FaultPlan.parse(args.faults)
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    server = ChatServer(ChatModel(args.model_dir, args.dtype), args.port, faults, args.request_log, args.api_key)
    print(f"listening on {server.url.removesuffix('/v1')}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.faults.release.set()
        server.server_close()


if __name__ == "__main__":
    main()
