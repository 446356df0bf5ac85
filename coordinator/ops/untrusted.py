"""Device-supplied text made safe to print: every free-text field a device sends (its
hello's ``profile`` and ``sdk_version``, the settings it reports not applied) passes
:func:`safe_text` before it reaches the registry, a log line, the terminal or the
dashboard, so that no device can forge a log line (a newline), recolour or rewrite the
operator's terminal (ANSI escapes, carriage returns), reorder text (bidirectional
controls) or flood a line.
"""

from __future__ import annotations

from collections.abc import Mapping

#: the most characters of one device-supplied string that are shown
MAX_SHOWN = 64


def safe_text(text: object, limit: int = MAX_SHOWN, *, backslash: bool = True) -> str:
    """``text`` printable and bounded: every character that is not printable (control,
    format, line and paragraph separators) as its escape (``\\n``, ``\\x1b``,
    ``\\u202e``), a backslash doubled (so that an escape in the output always stands for
    one character of the input; ``backslash=False`` leaves them, for text such as a
    message that quotes values with ``repr``), and at most ``limit`` characters of the
    result, a longer one cut and marked with ``...``."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and (not backslash or "\\" not in s) and len(s) <= limit:
        return s
    out: list[str] = []
    n = 0
    for ch in s:
        if ch == "\\" and backslash:
            piece = "\\\\"
        elif ch.isprintable():
            piece = ch
        else:
            piece = ch.encode("unicode_escape").decode("ascii")
        n += len(piece)
        if n > limit:
            return "".join(out) + "..."
        out.append(piece)
    return "".join(out)


def safe_map(items: Mapping[str, str], limit: int = MAX_SHOWN) -> dict[str, str]:
    """A ``{key: text}`` map a device sent, keys and values through :func:`safe_text`."""
    return {safe_text(k, limit): safe_text(v, limit) for k, v in items.items()}
