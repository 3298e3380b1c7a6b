"""Making names from files safe to print on a terminal, on one line; and sizes as people read them.

Tensor names, file names inside archives and paths come from checkpoints, which may be
crafted: a newline in a name would forge lines of a report, an ESC sequence could
recolour, move the cursor or retitle the terminal, and a bidi override reorders what is
shown. Human output and error messages show such characters as Python-style escapes
(``\\n``, ``\\x1b``, ``\\u202e``); ``--json`` keeps the exact strings (JSON escapes them).
"""

from __future__ import annotations

import re

__all__ = ["MAX_ERROR_CHARS", "cap_line", "human_bytes", "printable"]

# C0 controls (tab, newline, ESC, ...), DEL, C1 controls (0x80-0x9f: CSI among them), the
# line and paragraph separators, and the bidi embedding/override/isolate/mark characters.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                     "\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

#: The most characters the CLI prints for one error line.
MAX_ERROR_CHARS = 2000


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control, line-break and bidi character escaped.

    Printable text (any script, emoji) is unchanged, so ordinary names print as they are.

    >>> printable("layer\\n\\x1b[2Jx")
    'layer\\\\n\\\\x1b[2Jx'
    """
    return _UNSAFE.sub(_escape, str(text))


def cap_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, saying it was cut and how to see it all."""
    if len(text) <= limit:
        return text
    kept = max(0, limit - 80)  # the marker takes fewer than 80 characters
    return text[:kept] + f" ... [cut: {len(text) - kept} more characters; --debug shows all]"


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``: a size as the text output and the HTML reports show it."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
