"""Text from a checkpoint made safe to print: ``printable`` escapes exactly the characters
that could forge lines or drive a terminal (C0 and C1 controls, DEL, line and paragraph
separators, bidi marks, embeddings, overrides and isolates) and nothing else; ``cap_line``
keeps an error line within its limit and says what it cut.

Specifies ``fsdpckpt._printable`` directly, character class by character class; how each
command's output uses it is in ``test_escaping.py``.
"""

from __future__ import annotations

import pytest

from fsdpckpt._printable import MAX_ERROR_CHARS, cap_line, printable

# --- printable: what is escaped, and how --------------------------------------------------

@pytest.mark.parametrize("char, shown", [
    ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"),  # the three with short names
    ("\x00", "\\x00"), ("\x1b", "\\x1b"), ("\x1f", "\\x1f"),  # the rest of C0
    ("\x7f", "\\x7f"),  # DEL
    ("\x80", "\\x80"), ("\x9b", "\\x9b"), ("\x9f", "\\x9f"),  # C1 (0x9b is CSI)
    ("\u2028", "\\u2028"), ("\u2029", "\\u2029"),  # line and paragraph separators
    ("\u061c", "\\u061c"), ("\u200e", "\\u200e"), ("\u200f", "\\u200f"),  # bidi marks
    ("\u202a", "\\u202a"), ("\u202e", "\\u202e"),  # embeddings and overrides
    ("\u2066", "\\u2066"), ("\u2069", "\\u2069"),  # isolates
])
def test_each_unsafe_character_is_shown_as_its_python_escape(char, shown):
    assert printable(f"a{char}b") == f"a{shown}b"


@pytest.mark.parametrize("char", [" ", "~", "\xa0", "\xe9", "\u200d", "\u2027", "\u202f",
                                  "\u2065", "\u206a", "\U0001f642"],
                         ids=["space", "tilde", "nbsp", "e-acute", "zwj", "2027", "202f",
                              "2065", "206a", "emoji"])
def test_characters_next_to_the_unsafe_ranges_are_kept(char):
    assert printable(f"a{char}b") == f"a{char}b"


def test_printable_escapes_every_unsafe_character_in_a_run():
    assert printable("\x1b[2J\x1b]0;title\x07") == "\\x1b[2J\\x1b]0;title\\x07"


def test_printable_of_a_non_string_prints_its_str():
    assert printable(5) == "5" and printable(None) == "None"
    assert printable(ValueError("a\nb")) == "a\\nb"


def test_no_control_separator_or_bidi_character_survives_anywhere_in_unicode():
    import sys
    import unicodedata

    bidi_controls = {"\u061c", "\u200e", "\u200f", *map(chr, range(0x202a, 0x202f)),
                     *map(chr, range(0x2066, 0x206a))}
    shown = printable("".join(map(chr, range(sys.maxunicode + 1))))
    survivors = {c for c in shown if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                 or c in bidi_controls}
    assert survivors == set()


# --- cap_line -----------------------------------------------------------------------------

def test_a_line_of_exactly_the_limit_is_kept_whole():
    assert cap_line("x" * MAX_ERROR_CHARS) == "x" * MAX_ERROR_CHARS


@pytest.mark.parametrize("limit", [80, 100, 500, MAX_ERROR_CHARS])
def test_a_cut_line_fits_its_limit_and_counts_what_it_cut(limit):
    text = "".join(chr(ord("a") + i % 26) for i in range(limit * 3))
    line = cap_line(text, limit)
    assert len(line) <= limit
    kept, marker = line.split(" ... [cut: ")
    assert text.startswith(kept)
    assert marker == f"{len(text) - len(kept)} more characters; --debug shows all]"
