"""The few exception types fedbit raises on purpose.

Every one names its culprit (a field, a file and key, a codec) in its message. They derive
from ``ValueError`` so that generic callers that catch bad input keep working.
"""


class FedbitError(Exception):
    """Base class of fedbit's own errors."""


class ProtocolError(FedbitError, ValueError):
    """A wire message or encoded tensor is malformed; the message names the field."""


class CodecError(FedbitError, ValueError):
    """A codec was asked for something it cannot do (unknown name, bits out of range,
    NaN/Inf input, wrong dtype). Decoding a malformed *received* tensor raises
    :class:`ProtocolError` instead."""


class ConfigError(FedbitError, ValueError):
    """A configuration (hardware profile TOML, CLI option, strategy name) is invalid."""


class TrainingError(FedbitError, RuntimeError):
    """Local training could not run (data and model disagree, weights out of domain)."""
