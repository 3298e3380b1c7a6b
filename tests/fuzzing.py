"""What the fuzz suites share: one budget, and byte-level damage to real files.

Every parser of checkpoint bytes has a seeded hypothesis suite (``tests/test_fuzz_*.py``,
the manifest's in ``test_manifest_trust.py``, RNG files' in ``test_rng.py``) with a
bounded budget, so CI runs each in seconds and every run sees the same examples.

A longer run by hand:  FSDPCKPT_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz_*.py
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("FSDPCKPT_FUZZ_EXAMPLES", "200"))

_ANY_BYTE = st.integers(0, 255)

#: The byte-level changes :func:`damaged` makes, one per step.
BYTE_DAMAGE = ("flip", "byte", "cut", "insert", "drop", "splice")


def fuzz_settings(fraction: float = 1.0, minimum: int = 10) -> settings:
    """Seeded settings for ``fraction`` of the budget (at least ``minimum`` examples)."""
    return settings(max_examples=max(minimum, int(EXAMPLES * fraction)), deadline=None,
                    derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@st.composite
def damaged(draw: st.DrawFn, source: bytes, *, steps: int = 8,
            kinds: tuple[str, ...] = BYTE_DAMAGE,
            where: Callable[[bytearray], st.SearchStrategy[int]] | None = None,
            values: st.SearchStrategy[int] = _ANY_BYTE,
            custom: dict[str, Callable[[bytearray], st.SearchStrategy[None]]] | None = None,
            ) -> bytes:
    """``source`` after 1 to ``steps`` changes drawn from ``kinds``: a flipped bit, an
    overwritten byte (from ``values``), a cut to the end, inserted random bytes, a dropped
    run, a run spliced in from elsewhere in the file. ``where`` draws positions (default:
    anywhere); ``custom`` maps more kinds to strategies that change the data in place."""
    data = bytearray(source)
    for _ in range(draw(st.integers(1, steps))):
        if not data:
            break
        how = draw(st.sampled_from(kinds))
        if custom and how in custom:
            draw(custom[how](data))
            continue
        at = draw(where(data) if where else st.integers(0, len(data) - 1))
        if how == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "byte":
            data[at] = draw(values)
        elif how == "cut":
            del data[at:]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif how == "drop":
            del data[at:at + draw(st.integers(1, 64))]
        elif how == "splice":
            start = draw(st.integers(0, len(data) - 1))
            data[at:at] = data[start:start + draw(st.integers(1, 64))]
        else:
            raise ValueError(f"unknown kind of damage {how!r}")
    return bytes(data)
