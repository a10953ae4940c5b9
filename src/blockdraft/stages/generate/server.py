"""A small OpenAI-compatible chat endpoint for a local Hugging Face model, on 127.0.0.1 only.

It exists so that the `openai` engine is tested over real HTTP with the tiny target. Production generation uses
vLLM or SGLang, which batch requests, page the KV cache and scale across GPUs; this server answers one request at a
time with `transformers` greedy generation.

    python -m blockdraft.stages.generate.server MODEL_DIR [--port 0] [--faults 503,delay,ok --delay-s S] [--request-log FILE]

Endpoints: `POST /v1/chat/completions` (messages, max_tokens, temperature, chat_template_kwargs; answers with
`message.reasoning_content`, `prompt_token_ids` and `choices[0].token_ids` like vLLM with `return_token_ids`),
`GET /v1/models`, `GET /health`. It prints `listening on http://127.0.0.1:PORT` once it accepts connections.

Fault injection, for tests: `--faults 503,503,delay,ok` scripts the answers to the first chat requests in arrival order
(a status is answered as an error, `delay` waits `--delay-s` seconds before serving, `ok` serves). `request_log` gets two JSON lines per chat request:
{"request_id" (the X-Request-Id header), "arrived": its scripted answer} on arrival and {"request_id", "status"} once answered.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from blockdraft.decode.greedy import Prompt, greedy_generate


@dataclass
class FaultPlan:
    """The answers to the first chat requests, in arrival order: "503" (any status: answered with it), "delay" (served
    after `delay_s` seconds) or "ok"; requests after the script are served normally."""

    script: list[str] = field(default_factory=list)
    delay_s: float = 0.0

    @classmethod
    def parse(cls, script: str, delay_s: float) -> FaultPlan:
        steps = [s.strip() for s in script.split(",") if s.strip()]
        for step in steps:
            if step not in ("ok", "delay") and not (step.isdigit() and 400 <= int(step) <= 599):
                raise ValueError(f"fault step {step!r}: use ok, delay or an HTTP status 400-599")
        return cls(steps, delay_s)


class ChatModel:
    """The model and tokenizer behind the endpoint; one generation at a time (the lock), greedy unless temperature > 0."""

    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = Path(model_dir).name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self._lock = threading.Lock()

    def complete(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("'messages' must be a non-empty list of message objects")
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        prompt = Prompt(request_id, messages, thinking if isinstance(thinking, bool) else None)
        with self._lock:
            done = greedy_generate(self.model, self.tokenizer, [prompt], max_tokens, float(body.get("temperature") or 0.0))[0]
        prompt_ids, completion_ids = done.prompt_token_ids or [], done.completion_token_ids or []
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "prompt_token_ids": prompt_ids,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": done.content, "reasoning_content": done.reasoning_content},
                "finish_reason": done.finish_reason,
                "token_ids": completion_ids,
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                      "total_tokens": len(prompt_ids) + len(completion_ids)},
        }


class _Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the request log is the record
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
        self._send(status, {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                                      "code": status}})

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.server.chat.name, "object": "model", "owned_by": "blockdraft"}]})
        elif self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, f"no route {self.path}")
            return
        request_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        fault = self.server.next_fault()
        self.server.log_event({"request_id": request_id, "arrived": fault})
        status = self._answer(raw, request_id, fault)
        self.server.log_event({"request_id": request_id, "status": status})

    def _answer(self, raw: bytes, request_id: str, fault: str) -> int:
        if fault.isdigit():
            self._error(int(fault), "injected failure")
            return int(fault)
        if fault == "delay":
            time.sleep(self.server.faults.delay_s)
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
            answer = self.server.chat.complete(body, request_id)
        except Exception as exc:  # the prompt's fault (bad JSON, template error): a 400 with the reason, like vLLM
            self._error(400, f"{type(exc).__name__}: {exc}")
            return 400
        self._send(200, answer)
        return 200


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, chat: ChatModel, port: int = 0, faults: FaultPlan | None = None, request_log: str | None = None) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.chat = chat
        self.faults = faults or FaultPlan()
        self._request_log = request_log
        self._count = 0
        self._count_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def next_fault(self) -> str:
        with self._count_lock:
            n = self._count
            self._count += 1
        return self.faults.script[n] if n < len(self.faults.script) else "ok"

    def log_event(self, event: dict[str, Any]) -> None:
        if self._request_log is None:
            return
        with self._count_lock, open(self._request_log, "a") as f:
            f.write(json.dumps(event) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenAI-compatible chat endpoint for a local HF model (tests and demos; "
                                                 "use vLLM or SGLang in production).")
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for tiny models on a busy machine)")
    parser.add_argument("--faults", default="", help="answers to the first chat requests: comma-separated ok, delay or an HTTP status")
    parser.add_argument("--delay-s", type=float, default=0.0, help="how long a 'delay' step waits")
    parser.add_argument("--request-log", default=None)
    args = parser.parse_args()

    import torch

    try:
        faults = FaultPlan.parse(args.faults, args.delay_s)
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    chat = ChatModel(args.model_dir, args.dtype)
    server = ChatServer(chat, args.port, faults, args.request_log)
    print(f"listening on {server.url.removesuffix('/v1')}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
