"""Errors raised for bad input. Every message names the field at fault and how to fix it."""


class PolybasicError(Exception):
    """Base class of polybasic's own errors."""


class ConfigError(PolybasicError, ValueError):
    """A bad argument, recipe field or config value."""


class ModelNotFoundError(PolybasicError, FileNotFoundError):
    """A model name, path or package that cannot be resolved."""


def check(cond: bool, field: str, problem: str, fix: str) -> None:
    """Raise ConfigError('<field>: <problem>; <fix>') unless cond holds."""
    if not cond:
        raise ConfigError(f"{field}: {problem}; {fix}")


class DataNotFoundError(PolybasicError, FileNotFoundError):
    """A data file (prompts, calibration text, questions) that does not exist."""


class CorruptFileError(PolybasicError, ValueError):
    """A file that exists but cannot be read: damaged, truncated or of another format."""


class EngineError(PolybasicError, RuntimeError):
    """An external engine polybasic drives (vLLM in serve-check) failed or timed out; names its log."""
