"""A large ``.metadata`` unpickled at C speed, through the same allowlist.

A 1,024-rank checkpoint's ``.metadata`` is hundreds of MB and tens of millions of opcodes:
pickle's pure-Python unpickler (:class:`~fsdpckpt.dcp._safe_pickle.RestrictedUnpickler`)
takes minutes over it. Here pickle's C unpickler does the work, under the same rules:

- globals resolve only through the allowlist (``find_class``), whose values are all
  sealed (:class:`~fsdpckpt.dcp._allowlist.Sealed`): a BUILD, SETITEM(S), APPEND(S) or
  ADDITEMS aimed at one of them is refused by the value itself, so no pickle changes how a
  later file is read;
- before the C unpickler sees a byte, the walks of :mod:`fsdpckpt.dcp._pickle_walk` run:
  :func:`~fsdpckpt.dcp._pickle_scan.scan` (a regular expression, in C) finds every opcode,
  checks that frames tile them and refuses a memo index or a length past the pickle's
  size (the C unpickler would allocate for it first); the shape walk refuses keys that
  are costly to hash and nesting past a bound (the C unpickler hashes without a guard).
  The pure-Python reader runs the same walks, so both accept and refuse alike.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

from fsdpckpt.dcp._allowlist import _Refusal
from fsdpckpt.dcp._pickle_scan import _Unwalkable, scan  # noqa: F401 - both as before
from fsdpckpt.dcp._pickle_walk import WALK_LIMIT
from fsdpckpt.dcp._safe_pickle import refusal, refuse_global, unreadable, walked
from fsdpckpt.errors import FsdpCkptError

__all__ = ["fast_loads", "scan"]


class _Unpickler(pickle.Unpickler):
    """pickle's C unpickler, globals from the allowlist only, no persistent ids."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], source: str):
        self.file = io.BytesIO(data)
        super().__init__(self.file)
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            refuse_global(self._source, module, name)


def fast_loads(data: bytes, *, allowed: Mapping[tuple[str, str], Any], source: str) -> Any:
    """Unpickle ``data`` at C speed through ``allowed``, whose values must all be sealed.

    The same refusals as :func:`fsdpckpt.dcp._safe_pickle.safe_loads`, raised as the same
    errors: :class:`~fsdpckpt.errors.UnsafePickleError` for a global outside ``allowed`` or
    a state-setting opcode aimed at one inside it, :class:`~fsdpckpt.errors.NotACheckpointError`
    for bytes that are not a readable pickle.
    """
    walked(data, allowed, source=source, shape=len(data) <= WALK_LIMIT)
    unpickler = _Unpickler(data, allowed, source)
    try:
        return unpickler.load()
    except _Refusal as exc:
        raise refusal(source, exc.what, exc.opcode) from None
    except FsdpCkptError:
        raise
    except Exception as exc:  # the C unpickler's and the stand-ins' many ways to fail
        # Where the reader got to (the C unpickler reads a frame at a time).
        raise unreadable(source, unpickler.file.tell(), len(data), exc) from exc
