"""User-facing errors: one line that names the file and the fix, never a stack trace."""

from __future__ import annotations


class PipelineError(Exception):
    """A failure the user can fix. `str(err)` is the whole message shown to them."""

    def __init__(self, message: str, *, path: object | None = None, fix: str | None = None):
        parts = []
        if path is not None:
            parts.append(f"{path}:")
        parts.append(message.rstrip("."))
        text = " ".join(parts)
        if fix:
            text += f" — fix: {fix}"
        super().__init__(text)


class ConfigError(PipelineError):
    """A model / target / quantization config is wrong or unknown."""


class WeightsError(PipelineError):
    """A checkpoint file is missing, truncated, unsafe or does not match the config."""


class CompileError(PipelineError):
    """The compiler could not produce a valid library (e.g. an unscheduled GPU kernel)."""
