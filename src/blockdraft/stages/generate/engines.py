"""Engines that complete prompts with the target: `hf` (local transformers, batched greedy) and `openai` (any
OpenAI-compatible server: vLLM, SGLang, or the test suite's small endpoint).

An engine turns `Prompt`s into `Completion`s or `Failure`s and yields each as it finishes; it never drops one.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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
    batch that share their settings (`settings_used`) are generated together; sampling is seeded by the group's ids,
    so a rerun of the same batch writes the same answers."""

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
            groups.setdefault((used["temperature"], used.get("top_p"), used["max_new_tokens"]), []).append(prompt)
        for (temperature, top_p, max_new_tokens), group in groups.items():
            seed = zlib.crc32("\n".join(p.id for p in group).encode())
            yield from generate_completions(self.model, self.tokenizer, group, max_new_tokens, temperature, top_p,
                                            seed)


class RequestError(Exception):
    """A request that failed: `detail` is one line, redacted (a server may echo the key it was sent)."""

    def __init__(self, reason: str, detail: str, retryable: bool) -> None:
        detail = redact(detail)
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retryable = retryable


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
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if not reasoning and "</think>" in content:
        reasoning, content = split_reasoning(content)
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    completion_ids = choice.get("token_ids")
    if not (isinstance(prompt_ids, list) and isinstance(completion_ids, list)):
        prompt_ids = completion_ids = None
    return Completion(prompt_id, content, reasoning, choice.get("finish_reason") or "stop", prompt_ids, completion_ids)


class OpenAIEngine:
    """Chat completions from the OpenAI-compatible server at generate.base_url, per the [generate] section.

    At most `concurrency` requests in flight; each has a `timeout_s` deadline; 5xx/429/timeouts/connection errors are
    retried up to `max_retries` times with exponential backoff (`retry_backoff_s` * 2^attempt, jittered, capped at 30
    s); other 4xx answers are the prompt's fault and are not retried. The API key comes from the environment variable
    `api_key_env` and is sent only in the Authorization header; every error text is redacted before it is kept, so the
    key never reaches a failure record, a message or an artifact (docs/STORE.md, credentials).
    """

    def __init__(self, settings: GenerateConfig, seed: int = 0) -> None:
        if not settings.base_url:
            raise ConfigError("generate.engine is 'openai' but generate.base_url is not set; set it to the server's "
                              "/v1 URL")
        self.base_url = settings.base_url
        self.shown_url = safe_url(self.base_url).rstrip("/")  # what messages name: no password, no token
        remember_url(self.base_url)
        self.settings = settings
        self.concurrency = settings.concurrency
        self.timeout_s = settings.timeout_s
        self.max_retries = settings.max_retries
        self.backoff_s = settings.retry_backoff_s
        self.request_token_ids = settings.request_token_ids
        self._api_key = os.environ.get(settings.api_key_env) or None
        remember_secret(self._api_key)
        self._jitter = random.Random(seed)
        self.model = settings.model or self._served_model()

    def _headers(self, prompt_id: str | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        if prompt_id is not None:
            headers["X-Request-Id"] = prompt_id  # vLLM uses it as the request id in its logs
        return headers

    def _served_model(self) -> str:
        try:
            data = self._call("GET", "/models", None, None)
            return str(data["data"][0]["id"])
        except (RequestError, KeyError, IndexError, TypeError) as exc:
            detail = exc.detail if isinstance(exc, RequestError) else "no model listed"
            raise ConfigError(
                f"cannot ask {self.shown_url}/models which model it serves ({detail}); start the server or set "
                "generate.model"
            ) from None

    def _url(self, path: str) -> str:
        """`path` under the base URL as given, its query string (a gateway's token or API version) kept after the
        path."""
        base, mark, query = self.base_url.partition("?")
        return base.rstrip("/") + path + mark + query

    def _call(self, method: str, path: str, body: dict | None, prompt_id: str | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self._url(path), data=data, method=method, headers=self._headers(prompt_id))
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            raise RequestError(f"http_{exc.code}", f"HTTP {exc.code}: {message}",
                               exc.code in RETRYABLE_STATUSES) from None
        except TimeoutError:
            raise RequestError("timeout", f"no answer within {self.timeout_s:g} s", retryable=True) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise RequestError("timeout", f"no answer within {self.timeout_s:g} s", retryable=True) from None
            raise RequestError("connection", f"cannot reach {self.shown_url}: {exc.reason}", retryable=True) from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise RequestError("connection", f"connection to {self.shown_url} lost: {type(exc).__name__}",
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
        if kwargs := prompt.template_kwargs():
            body["chat_template_kwargs"] = kwargs
        if self.request_token_ids:
            body["return_token_ids"] = True
        return body

    def complete(self, prompt: Prompt) -> Completion | Failure:
        """One prompt, with retries; never raises for a server or network problem."""
        body = self.request_body(prompt)
        attempt = 0
        while True:
            attempt += 1
            try:
                return parse_chat_response(prompt.id, self._call("POST", "/chat/completions", body, prompt.id))
            except RequestError as exc:
                if not exc.retryable or attempt > self.max_retries:
                    return Failure(prompt.id, exc.reason, exc.detail[:300], attempt)  # detail: redacted by RequestError
            delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * (0.75 + 0.5 * self._jitter.random())
            time.sleep(delay)

    def run(self, prompts: Iterable[Prompt]) -> Iterator[Completion | Failure]:
        """Results in completion order; at most `concurrency` requests in flight and 2x that many prompts held.

        When the caller stops early (Ctrl-C), queued prompts are cancelled; only the requests in flight are awaited.
        """
        pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="generate")
        try:
            pending: set[concurrent.futures.Future] = set()
            for prompt in prompts:
                pending.add(pool.submit(self.complete, prompt))
                if len(pending) >= 2 * self.concurrency:
                    done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    for future in done:
                        yield future.result()
            for future in concurrent.futures.as_completed(pending):
                yield future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


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
