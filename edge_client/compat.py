"""The two things Python 3.10 and 3.11 added that the device side uses, for Python 3.9.

The device side (``edge_client``, ``firmware_models``, ``hw_profiles``, ``fedbit-edge``)
runs on Python >= 3.9: Raspberry Pi OS bullseye and JetPack 5 (``apt install python3.9``)
have 3.9, JetPack 6 has 3.10 (docs/device.md). ``tests/project/test_py39.py`` keeps newer syntax
and library calls out of it, and ``.ci/run`` runs it under a real 3.9 (``tools/py39_check.sh``).
``hw_profiles`` imports no SDK module, so ``hw_profiles/loader.py`` repeats the ``tomllib``
fallback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from itertools import zip_longest
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser from PyPI (the standard library's tomllib is tomli 2)
    import tomli as tomllib

__all__ = ["tomllib", "zip_strict"]

_MISSING = object()


def zip_strict(*iterables: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """``zip(*iterables, strict=True)`` (Python 3.10+) on every supported Python: the same
    tuples, and ``ValueError`` as soon as one iterable ends before the others."""
    for items in zip_longest(*iterables, fillvalue=_MISSING):
        if any(x is _MISSING for x in items):
            short = next(i for i, x in enumerate(items) if x is _MISSING)
            raise ValueError(f"zip_strict: argument {short + 1} is shorter than the others")
        yield items
