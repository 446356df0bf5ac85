"""The few exception types fedbit raises on purpose.

Every one names its culprit (a field, a file and key, a codec) in its message. They derive
from ``ValueError`` so that generic callers that catch bad input keep working.
"""


class FedbitError(Exception):
    """Base class of fedbit's own errors."""


class ProtocolError(FedbitError, ValueError):
    """A wire message or encoded tensor is malformed; the message names the field.

    ``reason`` labels the kind of fault for metrics and logs (the coordinator counts a
    rejected update under ``rejected_<reason>``): ``malformed`` (the default),
    ``oversized``, ``nonfinite`` (a NaN/Inf or float32-overflowing value anywhere),
    ``wrong_shape`` or ``out_of_range`` (|v| beyond the magnitude limit).
    """

    REASONS = frozenset({"malformed", "oversized", "nonfinite", "wrong_shape", "out_of_range"})

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        super().__init__(message)
        if reason not in self.REASONS:
            raise ValueError(f"ProtocolError reason {reason!r} not in {sorted(self.REASONS)}")
        self.reason = reason


class CodecError(FedbitError, ValueError):
    """A codec was asked for something it cannot do (unknown name, bits out of range,
    NaN/Inf input, wrong dtype). Decoding a malformed *received* tensor raises
    :class:`ProtocolError` instead."""


class ConfigError(FedbitError, ValueError):
    """A configuration (hardware profile TOML, CLI option, strategy name) is invalid."""


class TrainingError(FedbitError, RuntimeError):
    """Local training could not run (data and model disagree, weights out of domain)."""
