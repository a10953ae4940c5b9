"""The errors a user can cause and fix: bad input, a wrong config, a store that cannot be reached, an artifact that
does not verify. Each is one line naming the cause and the fix; the CLI prints it and exits 2. Anything else is a bug
and keeps its traceback.

`redact` is the gate every text from a server passes before it becomes part of such a line, a failure record or a
manifest: a server may echo the key it was sent ("Incorrect API key provided: ..."), and an artifact is shared.
`safe_url` is the form in which a URL is stored or printed: a URL may carry a password (`http://user:pw@host`) or a
token in its query string (`?token=...`), and neither may reach a manifest, a lease, a failure record or a message.
`redact_settings` is the form in which a config is pinned (manifests, checkpoints, exports): every credential a setting
carries becomes its `fingerprint`, so the pinned config names no secret and still changes when one does.
`printable` is the form in which a stored string (read from a manifest, a record beside an artifact, a key) is printed:
a newline or tab in it would forge a line or a column of `status` and PROGRESS.md.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import unicodedata
import urllib.parse
from typing import Any

FIRST_FEW = 5  # how many items of a long list a one-line message names


def first_few(items: list[str], rest: str = "") -> str:
    """`items` joined for a one-line message: the first FIRST_FEW, then how many more (and `rest`, where they are all
    listed), so a 100,000-problem artifact is still one short line."""
    head = "; ".join(items[:FIRST_FEW])
    if len(items) <= FIRST_FEW:
        return head
    return f"{head} (+{len(items) - FIRST_FEW:,} more{'; ' + rest if rest else ''})"


class BlockdraftError(Exception):
    """Base of every user-facing error: the message is one line naming the cause and the fix."""


class ConfigError(BlockdraftError, ValueError):
    """A config field, flag or file the user gave is wrong or missing."""


class StoreError(BlockdraftError, RuntimeError):
    """A store cannot be used: bad URL, missing credentials, unreachable endpoint, full disk."""


class ArtifactError(BlockdraftError, RuntimeError):
    """An artifact is not what a stage needs: not verified, the wrong kind, or not readable back as written."""


class OutsideArtifactError(ArtifactError):
    """A file of an artifact that resolves outside the artifact's folder (a planted '..' entry, a symlink out of it)."""


class SpecError(BlockdraftError, ValueError):
    """A drafter shape or DFlash parameter that contradicts the target or the checkpoint."""


class DecodeError(BlockdraftError, ValueError):
    """A target or setting the decode loop cannot run correctly (e.g. state that cannot be rolled back)."""


class ExportError(BlockdraftError, ValueError):
    """An export the serving engines would load wrongly or not at all."""


class EvalError(ConfigError):
    """An eval whose checkpoint, prompts or settings contradict each other."""


class RankLostError(BlockdraftError, RuntimeError):
    """A collective of a distributed run failed: another rank (or its whole node) stopped or did not answer in time."""


class DivergedError(BlockdraftError, RuntimeError):
    """Training produced a loss, a gradient norm or weights that are not finite (NaN or infinite): the run stops."""


class EngineError(BlockdraftError, RuntimeError):
    """The serving engine is missing, did not start, or did not answer (`eval --engine`)."""


class LeaseError(StoreError):
    """Another writer holds the output (its lease names it), or this writer lost its lease before committing."""


class TrainingInterrupted(BlockdraftError):
    """Ctrl-C during `train`: the message names the last verified checkpoint (the one a rerun resumes from)."""


REDACTED = "[redacted]"
# Credentials read from the environment by name; a key read from another variable is added with `remember_secret`.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "OPENAI_API_KEY")
MIN_SECRET_CHARS = 6  # shorter values ("EMPTY", "x": what local servers accept) are no secret, and would mangle words
PREFIX_SECRET_CHARS = 8  # a server that cuts a key (or its base64) still shows this many of its first characters
_remembered: set[str] = set()
_TOKEN = r"[^\s\"',;}]"
# A URL in a text: a scheme, "://", then everything up to a space or a quote. Its userinfo is what precedes the last "@"
# before the first "/" (a password may hold "?" or "#"), its query and fragment whatever follows the first "?" or "#".
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]*")
_URL_PARTS = re.compile(r"(?s)([A-Za-z][A-Za-z0-9+.-]*://)(?:[^/]*@)?([^?#]*)")
_URL_SPLIT = re.compile(r"(?s)([A-Za-z][A-Za-z0-9+.-]*://)(?:([^/]*)@)?([^?#]*)(?:\?([^#]*))?(?:#(.*))?")
# Shapes of credentials whatever their value: an Authorization header's value, a bearer token, an OpenAI-style `sk-`
# key, an "api key ...: X" echo, and a 40-character AWS secret key written near the word "secret".
_PATTERNS = (
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?!\[redacted\])[^\"'\n]+"), r"\1" + REDACTED),
    (re.compile(r"(?i)\b(bearer\s+)(?!\[redacted\])" + _TOKEN + "+"), r"\1" + REDACTED),
    (re.compile(r"\bsk-[\w\-*.]{6,}"), REDACTED),
    (re.compile(r"(?i)(\bapi[ _-]?key\b[^:=\n]{0,32}[:=]\s*[\"']?)(?!\[redacted\])" + _TOKEN + "{6,}"),
     r"\1" + REDACTED),
    (re.compile(r"(?i)(secret[\w \"':=]{0,40}?)(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"),
     r"\1" + REDACTED),
)
# Where a setting or a text carries a credential whatever its value (docs/STORE.md, "Secrets in settings"): the value of
# a flag or key named for one (`--hf-token X`, `--api-key=X`, `token=X`, `password: X`; a name ending in token, api key,
# password, secret (access) key or credential: `--max-num-batched-tokens` ends in "tokens" and is none), and a value in
# the shape of a known token: Hugging Face `hf_...`, OpenAI `sk-...`, AWS access key ids `AKIA...`/`ASIA...`, GitHub's.
_CREDENTIAL_NAME = (
    r"[\w.-]*?(?:token|api[-_]?key|apikey|password|passwd|secret(?:[-_]access)?(?:[-_]key)?|credentials?)"
)
_CREDENTIAL_FLAG = re.compile(rf"(?i)--?{_CREDENTIAL_NAME}")  # one argv item, matched whole
_FINGERPRINT = re.compile(r"\[redacted:[0-9a-f]{12}\]")
_VALUE = r"[^\s\"',;&}]"
_CREDENTIAL_VALUE = re.compile(
    rf"(?i)(?<![\w-])((?:--?{_CREDENTIAL_NAME}(?:=|\s+))|(?:{_CREDENTIAL_NAME}\s*[=:]\s*))(?!\[redacted)({_VALUE}+)"
)
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}"
    r"|github_pat_\w{22,})\b"
)
FINGERPRINT_ROUNDS = 100_000  # PBKDF2 rounds per fingerprint: about 40 ms, so each guess at a secret costs as much


# Characters a stored string may not print as they are: controls (newline, tab, escape), invisible format characters
# (bidirectional overrides, zero-width joiners) and line or paragraph separators.
_UNPRINTABLE = ("Cc", "Cf", "Zl", "Zp")


def control_characters(text: str) -> bool:
    """Whether `text` holds a character `printable` escapes (a backslash aside)."""
    return any(unicodedata.category(c) in _UNPRINTABLE for c in text)


def printable(value: object) -> str:
    """`value` as text that is one line of what it says: each character of `_UNPRINTABLE` and each backslash escaped as
    Python writes them (`\\n`, `\\t`, `\\u202e`, `\\\\`), the rest as it is. Every string `status` reads from a store
    is printed through it, so a stored string never forges a line, a column or an artifact."""
    text = str(value)
    if "\\" not in text and not control_characters(text):
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if c == "\\" or unicodedata.category(c) in _UNPRINTABLE
                   else c for c in text)


def safe_url(url: str) -> str:
    """`url` as it may be stored or printed: without userinfo (`user:password@`), query string and fragment.

    `http://alice:pw@host:8000/v1?token=X` becomes `http://host:8000/v1`. A text without a scheme (a plain path) and a
    URL with none of these parts (`s3://bucket/prefix`, `file:///data`) come back unchanged. Connect with the URL as
    given.
    """
    found = _URL_PARTS.match(url)
    return found.group(1) + found.group(2) if found else url


def url_secrets(url: str) -> list[str]:
    """The credentials a URL carries: the password of its userinfo and the values of its query string."""
    parts = urllib.parse.urlsplit(url)
    values = [value for _, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)]
    return [v for v in (parts.password, *values) if v]


def remember_secret(value: str | None) -> None:
    """Add a credential this process sends (an API key, an AWS secret key or session token) to what `redact` removes."""
    if value and len(value) >= MIN_SECRET_CHARS:
        _remembered.add(value)


def remember_url(url: str | None) -> None:
    """Add the credentials a URL this process connects to carries (`url_secrets`) to what `redact` removes, so a server
    that echoes its request path (`no route /v1?token=...`) or a library that names the URL leaks none of them."""
    for secret in url_secrets(url or ""):
        remember_secret(secret)


def _forms(secret: str) -> set[str]:
    """How a secret may appear in a text: as is, URL- or JSON-escaped, and base64-encoded (standard or URL-safe)."""
    encoded = base64.b64encode(secret.encode()).decode()
    return {secret, urllib.parse.quote(secret, safe=""), json.dumps(secret)[1:-1], encoded, encoded.rstrip("="),
            encoded.replace("+", "-").replace("/", "_").rstrip("=")}


def redact(text: str, *secrets: str | None) -> str:
    """`text` without the credentials this process knows (remembered, in `SECRET_ENV`, or given), without the userinfo
    and query string of any URL in it (`safe_url`), and without anything shaped like a credential (see `_PATTERNS`).

    A known secret is also found escaped or base64-encoded (`_forms`), and cut: any form by its first
    `PREFIX_SECRET_CHARS` characters or more, up to the end of the token. Each becomes "[redacted]". Redact before
    truncating a text, so that a secret is never cut into an unrecognisable piece.
    """
    known = {*_remembered, *secrets, *(os.environ.get(name) for name in SECRET_ENV)}
    for secret in sorted((s for s in known if s and len(s) >= MIN_SECRET_CHARS), key=len, reverse=True):
        for form in sorted(_forms(secret), key=len, reverse=True):
            text = text.replace(form, REDACTED)
            if len(form) > PREFIX_SECRET_CHARS:
                text = re.sub(re.escape(form[:PREFIX_SECRET_CHARS]) + _TOKEN + "*", REDACTED, text)
    text = _URL_IN_TEXT.sub(lambda found: safe_url(found.group()), text)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    text = _CREDENTIAL_VALUE.sub(lambda found: _short_or(found, REDACTED), text)
    return _TOKEN_SHAPES.sub(REDACTED, text)


def _short_or(found: re.Match[str], replacement: str) -> str:
    """A credential name and its value in a text: the value replaced, unless it is shorter than a secret can be (a
    message naming `--api-key KEY` or `spec_token=12` as a placeholder or a field)."""
    name, value = found.group(1), found.group(2)
    return found.group() if len(value) < MIN_SECRET_CHARS else name + replacement


@functools.lru_cache(maxsize=1024)
def fingerprint(secret: str) -> str:
    """`[redacted:<12 hex>]`: what a pinned config holds in place of `secret`. The same secret gives the same
    fingerprint, so a stage key that depends on the setting still changes when the secret does (a rotated token makes
    the output again rather than pass for it); the 48 bits come from PBKDF2-SHA256 over FINGERPRINT_ROUNDS rounds, so
    testing a guessed password against it is slow, and a random token (hf_..., sk-...) is out of reach."""
    digest = hashlib.pbkdf2_hmac("sha256", secret.encode(), b"blockdraft setting fingerprint", FINGERPRINT_ROUNDS)
    return f"[redacted:{digest.hex()[:12]}]"


def _fingerprinted(value: str, secret: bool = True) -> str:
    """`value`'s fingerprint (`value` itself when empty or one already); a `secret` is also remembered
    (`remember_secret`), so a message of this process that names it is redacted too. A query value that need not be a
    credential is not remembered: it may be a word ("validation") that messages use."""
    if not value or _FINGERPRINT.fullmatch(value):
        return value
    if secret:
        remember_secret(value)
    return fingerprint(value)


# Query names kept as they are: the dataset config, split and revision `eval --prompts hf://datasets/...` reads.
_PLAIN_QUERY = ("config", "split", "revision")


def _redact_url(url: str) -> str:
    """`url` with its userinfo, each query value (an item without `=`: whole) and its fragment fingerprinted, but the
    values of `_PLAIN_QUERY`; scheme, host, path and query names kept. Split as `safe_url` splits (a password may hold
    "?" or "#"), not by urllib, which refuses a fingerprint's brackets in the authority."""
    found = _URL_SPLIT.match(url)
    if found is None:
        return url
    scheme, userinfo, path, query, fragment = found.groups()
    items = [item.partition("=") for item in (query or "").split("&") if item]
    query = "&".join(
        (f"{name}={value}" if name in _PLAIN_QUERY else f"{name}={_fingerprinted(value, _is_credential(name))}") if eq
        else _fingerprinted(name) for name, eq, value in items
    )
    if userinfo is not None and not _FINGERPRINT.fullmatch(userinfo):
        remember_secret(userinfo.partition(":")[2] or userinfo)  # `user:password` or a token alone
    return (scheme + (f"{_fingerprinted(userinfo, False)}@" if userinfo is not None else "") + path
            + (f"?{query}" if query else "") + (f"#{_fingerprinted(fragment, False)}" if fragment else ""))


def _is_credential(name: str) -> bool:
    return _CREDENTIAL_FLAG.fullmatch("--" + name) is not None


def redact_setting(value: str) -> str:
    """One setting's text as a config pins it: the userinfo, query values and fragment of each URL in it, the value of a
    credential flag or key in it (`--hf-token X`, `token=X`), and each known token shape, replaced by its `fingerprint`.
    A setting without any of these comes back unchanged, so the pinned config (and every stage key read from it) of a
    config without secrets is what it was."""
    value = _URL_IN_TEXT.sub(lambda found: _redact_url(found.group()), value)
    value = _CREDENTIAL_VALUE.sub(lambda found: found.group(1) + _fingerprinted(found.group(2)), value)
    return _TOKEN_SHAPES.sub(lambda found: _fingerprinted(found.group()), value)


def redact_settings(data: Any) -> Any:
    """`data` (a config as plain JSON data) with every string passed through `redact_setting`; in a list
    (`eval.engine_args`) the item after a credential flag given on its own (`["--hf-token", "X"]`) is fingerprinted
    whole."""
    if isinstance(data, dict):
        return {key: redact_settings(value) for key, value in data.items()}
    if isinstance(data, list):
        items = [redact_settings(value) for value in data]
        for i in range(1, len(data)):
            flag, value = data[i - 1], data[i]
            if isinstance(flag, str) and isinstance(value, str) and _CREDENTIAL_FLAG.fullmatch(flag):
                items[i] = _fingerprinted(value)
        return items
    return redact_setting(data) if isinstance(data, str) else data


__all__ = [
    "REDACTED", "ArtifactError", "BlockdraftError", "ConfigError", "DecodeError", "DivergedError", "EngineError",
    "EvalError", "ExportError", "LeaseError",
    "OutsideArtifactError", "SpecError", "StoreError", "control_characters", "fingerprint", "printable", "redact",
    "redact_setting", "redact_settings", "remember_secret", "remember_url", "safe_url", "url_secrets",
]
