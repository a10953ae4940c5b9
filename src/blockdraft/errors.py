"""The errors a user can cause and fix: bad input, a wrong config, a store that cannot be reached, an artifact that
does not verify. Each is one line naming the cause and the fix; the CLI prints it and exits 2. Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class BlockdraftError(Exception):
    """Base of every user-facing error: the message is one line naming the cause and the fix."""


class ConfigError(BlockdraftError, ValueError):
    """A config field, flag or file the user gave is wrong or missing."""


class StoreError(BlockdraftError, RuntimeError):
    """A store cannot be used: bad URL, missing credentials, unreachable endpoint, full disk."""


class ArtifactError(BlockdraftError, RuntimeError):
    """An artifact is not what a stage needs: not verified, the wrong kind, or not readable back as written."""


class SpecError(BlockdraftError, ValueError):
    """A drafter shape or DFlash parameter that contradicts the target or the checkpoint."""


class DecodeError(BlockdraftError, ValueError):
    """A target or setting the decode loop cannot run correctly (e.g. state that cannot be rolled back)."""


class ExportError(BlockdraftError, ValueError):
    """An export the serving engines would load wrongly or not at all."""


class EvalError(ConfigError):
    """An eval whose checkpoint, prompts or settings contradict each other."""


__all__ = ["ArtifactError", "BlockdraftError", "ConfigError", "DecodeError", "EvalError", "ExportError", "SpecError", "StoreError"]
