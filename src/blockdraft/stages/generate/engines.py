"""Engines that complete prompts with the target: `hf` (local transformers, batched greedy) and `openai` (any
OpenAI-compatible server: vLLM, SGLang, or the test suite's small endpoint).

An engine turns `Prompt`s into `Completion`s or `Failure`s and yields each as it finishes; it never drops one.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any, cast

from blockdraft.config import GenerateConfig, TargetConfig
from blockdraft.data.chat import Completion, Prompt, render_prompt, split_reasoning
from blockdraft.decode.batch_generate import generate_completions
from blockdraft.errors import ConfigError, redact, remember_secret, remember_url, safe_url
from blockdraft.model.target import load_target_config, target_dtype

# Statuses worth another try: the server is overloaded, restarting or timed out on its side.
RETRYABLE_STATUSES = {408, 409, 425, 429, 500, 502, 503, 504}
MAX_BACKOFF_S = 30.0


@dataclass
class Failure:
    """A prompt the engine could not complete: `reason` is a short code counted in the summary, `detail` one line."""

    id: str
    reason: str
    detail: str
    attempts: int


def settings_used(prompt: Prompt, settings: GenerateConfig) -> dict[str, Any]:
    """What `prompt` is generated with: its own settings (`Prompt.settings`) over the [generate] section's temperature
    and max_new_tokens; top_p and reasoning_effort only where the row sets them (else the engine's default)."""
    used: dict[str, Any] = {"temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens}
    used.update(prompt.settings)
    return used


class HFEngine:
    """Local transformers generation for small targets: the [target] section's model (and tokenizer) in target.dtype
    (unset: its config.json's), generate.batch_size prompts per `generate` call, greedy by default. The prompts of a
    batch that share their settings (`settings_used`) are generated together; sampling (temperature and top_p only:
    no top-k, whatever the model's generation config says) is seeded by the group's ids, so the same group sampled
    again writes the same answers."""

    def __init__(self, target: TargetConfig, settings: GenerateConfig, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not target.path:
            raise ConfigError("generate.engine is 'hf' but target.path is not set; set it to the target model's folder "
                              "or hub id")
        dtype = target_dtype(target.dtype, load_target_config(target.path))
        self.tokenizer = AutoTokenizer.from_pretrained(target.tokenizer or target.path)
        model = AutoModelForCausalLM.from_pretrained(target.path, dtype=getattr(torch, dtype))
        self.model = cast(torch.nn.Module, model).to(device).eval()
        self.settings = settings
        self.batch_size = settings.batch_size

    def run(self, prompts: Iterable[Prompt]) -> Iterator[Completion | Failure]:
        batch: list[Prompt] = []
        for prompt in prompts:
            batch.append(prompt)
            if len(batch) == self.batch_size:
                yield from self._run_batch(batch)
                batch = []
        if batch:
            yield from self._run_batch(batch)

    def _run_batch(self, batch: list[Prompt]) -> Iterator[Completion | Failure]:
        # A prompt the template rejects fails alone, not with its whole batch.
        renderable: list[Prompt] = []
        for prompt in batch:
            try:
                render_prompt(self.tokenizer, prompt)
                renderable.append(prompt)
            except Exception as exc:
                yield Failure(prompt.id, "template_error", f"{type(exc).__name__}: {exc}"[:300], 1)
        groups: dict[tuple[Any, ...], list[Prompt]] = {}
        for prompt in renderable:
            used = settings_used(prompt, self.settings)
            top_p = used.get("top_p") if used["temperature"] > 0 else None  # greedy ignores it
            groups.setdefault((used["temperature"], top_p, used["max_new_tokens"]), []).append(prompt)
        for (temperature, top_p, max_new_tokens), group in groups.items():
            seed = zlib.crc32("\n".join(p.id for p in group).encode())
            yield from generate_completions(self.model, self.tokenizer, group, max_new_tokens, temperature, top_p,
                                            seed)


class RequestError(Exception):
    """A request that failed: `detail` is one line, redacted (a server may echo the key it was sent). `server_fault`:
    the failure says nothing about the prompt (the server could not be reached, or does not serve the model name),
    so it costs the prompt no attempt."""

    def __init__(self, reason: str, detail: str, retryable: bool, server_fault: bool = False) -> None:
        detail = redact(detail)
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retryable = retryable
        self.server_fault = server_fault


# Answers that are the server's fault, not the prompt's: a model name (or route) it does not serve. A refused key (401,
# 403) fails the prompt at once, as the server's other refusals do: a rerun with the right key retries it.
SERVER_FAULT_STATUSES = {404}


def parse_chat_response(prompt_id: str, data: Any) -> Completion:
    """A `Completion` from an OpenAI chat-completions response body.

    Reads `reasoning_content` (vLLM/SGLang reasoning parsers; `reasoning` in newer vLLM), or splits an inline
    `<think>` block when the server runs without a parser; token ids from vLLM's `return_token_ids`
    (`prompt_token_ids` at the top level, `token_ids` in the choice).
    """
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestError("bad_response", "the response has no choices[0].message", retryable=True) from None
    if not isinstance(message, dict) or not isinstance(choice, dict):
        raise RequestError("bad_response", "choices[0].message is not an object", retryable=True)
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise RequestError("bad_response", "message.content is not text", retryable=True)
    tool_calls = message.get("tool_calls") or None
    if tool_calls is not None and not (isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)):
        raise RequestError("bad_response", "message.tool_calls is not a list of calls", retryable=True)
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if not reasoning and "</think>" in content:
        reasoning, content = split_reasoning(content)
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    completion_ids = choice.get("token_ids")
    if not (isinstance(prompt_ids, list) and isinstance(completion_ids, list)):
        prompt_ids = completion_ids = None
    return Completion(prompt_id, content, reasoning, choice.get("finish_reason") or "stop", prompt_ids, completion_ids,
                      tool_calls)


@dataclass
class _Server:
    """One OpenAI-compatible server of the fleet and how it is doing: prompts it completed, its run of failures, and
    until when it rests (`out_until`, monotonic seconds) after a failure."""

    url: str
    shown: str  # what the progress line names it by: host and port, no credentials
    done: int = 0
    streak: int = 0
    out_until: float = 0.0
    last_error: str = ""

    def state(self, now: float, elapsed: float) -> str:
        rate = f"{self.done / elapsed:.2f}/s" if elapsed > 0 else "-"
        return f"{self.shown} {self.done} done {rate}" + (" (down)" if now < self.out_until else "")


class OpenAIEngine:
    """Chat completions from the OpenAI-compatible servers at generate.base_url, per the [generate] section.

    Each server has `concurrency` requests in flight, each with a `timeout_s` deadline; every server takes the next
    prompt from one queue, so a fast server does more. A request that fails with a retryable error (5xx, 429, timeout,
    a connection that fails or drops) sends that server to rest (`retry_backoff_s` * 2^(failures in a row - 1),
    jittered, capped at 30 s) and puts the prompt back at the head of the queue, for whichever server is up next. A
    server that cannot be reached, or answers 404 (it does not serve that model name), says nothing about the prompt,
    so that costs the prompt no attempt; any other retryable failure (a connection dropped after the request was sent,
    a timeout, 5xx, 429) does, and after `max_retries` retries the prompt is recorded failed, as is at once a prompt the
    server refuses (other 4xx, a refused key among them). When no server has answered anything for
    `servers_down_timeout_s` while prompts wait, the run ends (`run`): what was done is kept, a rerun generates the
    rest. The API key comes from the environment variable `api_key_env` and is sent only in the Authorization header;
    every error text is redacted before it is kept, so the key never reaches a failure record, a message or an
    artifact (docs/STORE.md, credentials).
    """

    def __init__(self, settings: GenerateConfig, seed: int = 0) -> None:
        if not settings.base_url:
            raise ConfigError("generate.engine is 'openai' but generate.base_url is not set; set it to the server's "
                              "/v1 URL (or a list of them)")
        for url in settings.base_url:
            remember_url(url)
        self.servers = [_Server(url, _host(url)) for url in settings.base_url]
        self.settings = settings
        self.concurrency = settings.concurrency
        self.timeout_s = settings.timeout_s
        self.max_retries = settings.max_retries
        self.backoff_s = settings.retry_backoff_s
        self.request_token_ids = settings.request_token_ids
        self._api_key = os.environ.get(settings.api_key_env) or None
        remember_secret(self._api_key)
        if self._api_key is not None and (self._api_key != self._api_key.strip() or not self._api_key.isprintable()):
            raise ConfigError(f"${settings.api_key_env} holds whitespace or a line break around or inside the key (a "
                              "line ending copied with it?); set it to the key alone")
        self._jitter = random.Random(seed)
        self._started = self._silent_since = time.monotonic()
        self.down: str | None = None  # the line saying every server was down, once a run ended on it
        self.model = self._fleet_model(settings.model)

    def _headers(self, prompt_id: str | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        if prompt_id is not None:
            headers["X-Request-Id"] = prompt_id  # vLLM uses it as the request id in its logs
        return headers

    def _fleet_model(self, configured: str | None) -> str:
        """The model the fleet serves: `configured`, else the first reachable server's first listed. Every server that
        lists its models must list it (a fleet serves one model under one name): else ConfigError naming that server.
        A server that cannot be asked now is skipped (it may be starting, or refuse the key: its requests say so); with
        no model configured and no server that lists one, ConfigError naming each server's problem."""
        model, problems = configured, []
        for server in self.servers:
            shown = safe_url(server.url).rstrip("/")
            try:
                listed = self._call(server, "GET", "/models", None, None)
                names = [str(entry["id"]) for entry in listed["data"]]
            except RequestError as exc:
                problems.append(f"{shown}: {exc.detail}")
                continue
            except (KeyError, TypeError):
                problems.append(f"{shown}: its /models lists no model")
                continue
            if model is None and names:
                model = names[0]
            elif model is not None and model not in names:
                raise ConfigError(f"{shown} serves {', '.join(names) or 'no model'}, not {model}: every server of "
                                  "generate.base_url must serve the target under one name; fix that server, or set "
                                  "generate.model to the name they all serve")
        if model is None:
            raise ConfigError(f"cannot ask any server which model it serves ({'; '.join(problems)}); start them, or "
                              "set generate.model")
        return model

    @staticmethod
    def _url(base_url: str, path: str) -> str:
        """`path` under the base URL as given, its query string (a gateway's token or API version) kept after the
        path."""
        base, mark, query = base_url.partition("?")
        return base.rstrip("/") + path + mark + query

    def _call(self, server: _Server, method: str, path: str, body: dict | None, prompt_id: str | None) -> Any:
        shown = safe_url(server.url).rstrip("/")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self._url(server.url, path), data=data, method=method,
                                         headers=self._headers(prompt_id))
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            fault = exc.code in SERVER_FAULT_STATUSES
            raise RequestError(f"http_{exc.code}", f"HTTP {exc.code}: {message}",
                               exc.code in RETRYABLE_STATUSES or fault, server_fault=fault) from None
        except TimeoutError:  # sent, and no answer in time
            raise RequestError("timeout", f"no answer within {self.timeout_s:g} s", retryable=True) from None
        except urllib.error.URLError as exc:  # never connected: the prompt never reached the server
            why = "timed out" if isinstance(exc.reason, TimeoutError) else exc.reason
            raise RequestError("connection", f"cannot reach {shown}: {why}", retryable=True,
                               server_fault=True) from None
        except (ConnectionError, http.client.HTTPException) as exc:  # dropped after the prompt was sent
            raise RequestError("connection", f"connection to {shown} lost: {type(exc).__name__}",
                               retryable=True) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RequestError("bad_response", "the server answered with invalid JSON", retryable=True) from None

    def request_body(self, prompt: Prompt) -> dict[str, Any]:
        used = settings_used(prompt, self.settings)
        body: dict[str, Any] = {
            "model": self.model, "messages": prompt.messages, "max_tokens": used["max_new_tokens"],
            "temperature": used["temperature"],
        }
        if "top_p" in used:
            body["top_p"] = used["top_p"]
        if prompt.tools:
            body["tools"] = prompt.tools
        if kwargs := prompt.template_kwargs():
            body["chat_template_kwargs"] = kwargs
        if self.request_token_ids:
            body["return_token_ids"] = True
        return body

    def progress(self) -> str:
        """Each server's completions, rate and whether it rests: what the progress line shows beside the count."""
        now = time.monotonic()
        return ", ".join(server.state(now, now - self._started) for server in self.servers)

    def run(self, prompts: Iterable[Prompt]) -> Iterator[Completion | Failure]:
        """Results in completion order, every prompt exactly once: a completion, or a failure. When no server has
        answered (a completion, or a refusal that is the prompt's fault) for `servers_down_timeout_s`, or `timeout_s`
        if that is longer (a request may take that long), every prompt not done yet is a failure (reason
        `servers_down`, detail `down`, the one line that says so) and the run ends; a run after one that ended so ends
        the same way at once unless a server answers. When the caller stops early (Ctrl-C), queued prompts are
        dropped and only the requests in flight are awaited."""
        queue: deque[tuple[Prompt, int]] = deque((prompt, 0) for prompt in prompts)
        results: Queue[Completion | Failure] = Queue()
        cond = threading.Condition()
        stop = threading.Event()
        in_flight: dict[str, Prompt] = {}
        open_prompts = [len(queue)]  # queued or in flight
        # when a server last answered; after a run that ended on every server down, that run's silence goes on
        answered = [self._silent_since if self.down is not None else time.monotonic()]
        window = max(self.settings.servers_down_timeout_s, self.timeout_s)

        def take(server: _Server) -> tuple[Prompt, int] | None:
            with cond:
                while not stop.is_set() and open_prompts[0] > 0:
                    now = time.monotonic()
                    if queue and now >= server.out_until:
                        prompt, attempts = queue.popleft()
                        in_flight[prompt.id] = prompt
                        return prompt, attempts
                    # resting: until the rest ends; up with nothing queued: until a prompt comes back or all is done
                    cond.wait(timeout=min(0.5, server.out_until - now) if now < server.out_until else 0.5)
                return None

        def serve(server: _Server) -> None:
            while (job := take(server)) is not None:
                prompt, attempts = job
                try:
                    answer = self._call(server, "POST", "/chat/completions", self.request_body(prompt), prompt.id)
                    done: Completion | Failure = parse_chat_response(prompt.id, answer)
                    error = None
                except RequestError as exc:
                    error = exc
                    done = Failure(prompt.id, exc.reason, exc.detail[:300], attempts + 1)  # detail: redacted
                except Exception as exc:  # anything else fails this prompt alone, in one redacted line
                    error = RequestError("internal", f"{type(exc).__name__}: {exc}", retryable=False)
                    done = Failure(prompt.id, error.reason, error.detail[:300], attempts + 1)
                with cond:
                    if stop.is_set():
                        return  # the run has ended: this prompt was yielded as a failure, or the caller stopped
                    del in_flight[prompt.id]
                    if error is None or not (error.retryable or error.server_fault or error.reason == "internal"):
                        answered[0] = time.monotonic()  # a completion, or a refusal that is the prompt's fault
                    if error is None or not error.retryable:
                        server.streak = 0
                        server.done += error is None
                    else:
                        server.streak += 1
                        server.last_error = error.detail
                        rest = min(MAX_BACKOFF_S, self.backoff_s * 2 ** min(server.streak - 1, 16))
                        server.out_until = time.monotonic() + rest * (0.75 + 0.5 * self._jitter.random())
                        spent = attempts + (not error.server_fault)  # the server's fault costs the prompt nothing
                        if spent <= self.max_retries or error.server_fault:
                            queue.appendleft((prompt, spent))  # next, on whichever server is up first
                            cond.notify_all()
                            continue
                    open_prompts[0] -= 1
                    results.put(done)
                    cond.notify_all()

        total = len(queue)
        threads = [threading.Thread(target=serve, args=(server,), name=f"generate-{i}-{k}", daemon=True)
                   for i, server in enumerate(self.servers) for k in range(self.concurrency)]
        for thread in threads:
            thread.start()
        down = False
        try:
            yielded = 0
            while yielded < total:
                try:
                    item = results.get(timeout=0.5)
                except Empty:
                    with cond:
                        silent = time.monotonic() - answered[0]
                        if silent > window and open_prompts[0] > 0:
                            stop.set()
                            left = [prompt for prompt, _ in queue] + list(in_flight.values())
                            down = True
                    if not down:
                        continue
                    self._silent_since = answered[0]
                    self.down = self._down_line(silent, len(left))
                    while not results.empty():  # finished before the stop: kept
                        yield results.get()
                    for prompt in left:
                        yield Failure(prompt.id, "servers_down", self.down[:300], 0)
                    return
                yielded += 1
                if not isinstance(item, Failure):
                    self.down = None  # a server answers again
                yield item
        finally:
            stop.set()
            with cond:
                cond.notify_all()
            if not down:  # a request in flight to a down server may hang until its timeout: not waited for
                for thread in threads:
                    thread.join()

    def _down_line(self, silent: float, left: int) -> str:
        errors = "; ".join(f"{safe_url(s.url).rstrip('/')}: {s.last_error or 'no answer'}" for s in self.servers)
        return (f"no generate server answered for {silent:.0f} s ({errors}); the {left} prompts not done are recorded "
                "as failed (servers_down), every completion before them is kept: start the servers (or fix "
                "generate.base_url) and rerun the same command to generate only those")


def _host(url: str) -> str:
    """host:port of a server URL (an IPv6 host in brackets), what the progress line names it by."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        return safe_url(url)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return host + (f":{parts.port}" if parts.port else "")


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's error message (OpenAI `{"error": {"message": ...}}` or FastAPI `{"detail": ...}`), one line,
    redacted."""
    try:
        body = json.loads(exc.read() or b"{}")
    except (ValueError, OSError):
        return exc.reason or "error"
    if not isinstance(body, dict):
        return exc.reason or "error"
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else (error or body.get("detail") or body.get("message"))
    # redacted whole: a cut key is harder to recognise
    return redact(" ".join(str(message or exc.reason).split()))[:200]
