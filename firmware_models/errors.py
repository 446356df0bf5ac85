"""Errors raised by model specs."""


class SpecError(ValueError):
    """A model specification is inconsistent (shapes do not chain, unknown name...)."""
