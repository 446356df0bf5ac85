"""edge_client.compat: what the device side uses of Python 3.10/3.11, on 3.9 too."""

from __future__ import annotations

import sys

import pytest

from edge_client.compat import tomllib, zip_strict


def test_zip_strict_is_zip_that_refuses_unequal_lengths() -> None:
    assert list(zip_strict([1, 2], "ab", (x for x in (3.0, 4.0)))) == [(1, "a", 3.0), (2, "b", 4.0)]
    assert list(zip_strict()) == [] and list(zip_strict([], [])) == []
    with pytest.raises(ValueError, match="argument 2 is shorter"):
        list(zip_strict([1, 2, 3], [1, 2]))
    with pytest.raises(ValueError, match="argument 1 is shorter"):
        list(zip_strict([1], [1, 2]))
    pairs = zip_strict([1, 2], [1])
    assert next(pairs) == (1, 1)  # lazy, like zip: the mismatch shows where it is reached
    with pytest.raises(ValueError):
        next(pairs)


def test_tomllib_is_the_standard_library_s_or_tomli() -> None:
    assert tomllib.__name__ == ("tomllib" if sys.version_info >= (3, 11) else "tomli")
    assert tomllib.loads('python = "3.9"\n') == {"python": "3.9"}
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads("python = \n")
