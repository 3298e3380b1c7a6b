"""``load_state(exclude=...)``: parts and model keys left out of a load (torchtitan's
``exclude_from_loading``), e.g. to fine-tune from a checkpoint with a new optimizer or head.

A name that is a part is a part; anything else is a glob on the model's state-dict keys.
Every name must mean something: a typo that silently loaded everything would be worse
than an error, so an unknown part or a glob that matches no key raises before any load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from fsdpckpt.errors import OptionError
from fsdpckpt.training._statecheck import Comparison

__all__ = ["PARTS", "Exclusion", "exclusion"]

PARTS = ("optimizer", "scheduler", "scaler", "rng", "extra", "dataloader")
"""The parts of a checkpoint ``exclude`` may name; the model is left out by key globs."""

_GLOB_CHARS = set("*?[.")


@dataclass(frozen=True)
class Exclusion:
    """What one load leaves out.

    Attributes:
        parts: part names from :data:`PARTS`.
        globs: fnmatch patterns on the model's state-dict keys.
    """

    parts: frozenset[str] = frozenset()
    globs: tuple[str, ...] = ()

    def __contains__(self, part: str) -> bool:
        return part in self.parts

    def excludes_key(self, key: str) -> bool:
        """True when the model key ``key`` matches one of the globs."""
        return any(fnmatchcase(key, glob) for glob in self.globs)

    def without_keys(self, comparison: Comparison) -> Comparison:
        """``comparison`` less the excluded keys: the strict check ignores them."""
        return Comparison([k for k in comparison.missing if not self.excludes_key(k)],
                          [k for k in comparison.unexpected if not self.excludes_key(k)],
                          [m for m in comparison.mismatched if not self.excludes_key(m.key)])

    def check_globs(self, keys: Iterable[str]) -> None:
        """Refuse a glob that matches none of ``keys`` (the model's and the checkpoint's)."""
        keys = list(keys)
        for glob in self.globs:
            if not any(fnmatchcase(key, glob) for key in keys):
                if _GLOB_CHARS & set(glob):
                    raise OptionError(f"exclude={glob!r} matches no key of the model or the "
                                      "checkpoint; nothing was loaded")
                raise OptionError(f"exclude: unknown part {glob!r} (the parts are "
                                  f"{', '.join(PARTS)}), and no model key is named so; "
                                  "nothing was loaded")


def exclusion(exclude: str | Iterable[str] | None) -> Exclusion:
    """Split ``exclude`` (one name or several) into parts and model-key globs.

    A name that is not a part is a glob, checked against the keys by
    :meth:`Exclusion.check_globs`; one without glob characters that matches nothing
    (``"optimzer"``) is refused there as an unknown part, with the valid names.
    """
    names = [exclude] if isinstance(exclude, str) else list(exclude or ())
    parts, globs = set(), []
    for name in names:
        if not isinstance(name, str) or not name:
            raise OptionError(f"exclude: {name!r} is not a part name or a key glob")
        if name in PARTS:
            parts.add(name)
        else:
            globs.append(name)
    return Exclusion(frozenset(parts), tuple(globs))
