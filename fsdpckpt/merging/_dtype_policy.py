"""Which dtype each merged tensor gets: the one policy behind ``--dtype`` and ``--optimizer-dtype``.

``--dtype`` (``dtype=``) casts the model's floating-point tensors. An optimizer's tensors
keep their stored dtype unless ``--optimizer-dtype`` (``optimizer_dtype=``) names one for
its moments (``exp_avg``, ``exp_avg_sq``, momentum buffers): a bf16 ``exp_avg_sq`` is rarely
wanted, and a merged optimizer is kept to resume from. Counters and scalars are never cast:
torch keeps AdamW's ``step`` as a float32 tensor, and bf16 holds integers exactly only up to
256 (a step of 257 becomes 256, 100001 becomes 99840: Adam's bias correction goes wrong on
resume); ASGD's 0-dimensional ``eta`` and ``mu`` are rates the next step uses as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import KeyPath

__all__ = ["DtypePolicy", "KeptDtypes", "holds_optimizer", "is_counter", "WHY_KEPT"]

#: Why an optimizer tensor kept its dtype although a cast was asked: said once, here.
WHY_KEPT = "--dtype casts the model; --optimizer-dtype the optimizer's moments"


def holds_optimizer(key_paths: Sequence[KeyPath]) -> bool:
    """Whether every entry sits under the key ``optimizer`` (Accelerate's ``optimizer_0/``
    given as a plain DCP folder, which its name alone need not say)."""
    return bool(key_paths) and all(k and k[0] == "optimizer" for k in key_paths)


def is_counter(name: str, shape: Sequence[int]) -> bool:
    """An optimizer entry that is a counter or a scalar: its last name segment is ``step``
    (per-parameter, or a shared one), or it has no dimension (ASGD's ``eta``, ``mu``)."""
    return name.rsplit(".", 1)[-1] == "step" or len(shape) == 0


@dataclass(frozen=True)
class DtypePolicy:
    """The dtypes asked for: ``model`` (``--dtype``) and ``optimizer`` (``--optimizer-dtype``);
    None keeps the stored ones."""

    model: DType | None = None
    optimizer: DType | None = None

    def planned(self, kind: str, name: str, shape: Sequence[int], stored: DType) -> DType:
        """The output dtype of the tensor ``name`` of a part of ``kind`` (``"model"``,
        ``"optimizer"``), stored as ``stored``. Integer and bool tensors keep theirs."""
        if not stored.is_floating:
            return stored
        if kind != "optimizer":
            return self.model or stored
        if is_counter(name, shape):
            return stored
        return self.optimizer or stored

    def kept(self, kind: str, stored: DType, planned: DType) -> bool:
        """Whether a cast asked for left this floating-point optimizer tensor as stored:
        what the merge's report names (a model tensor is cast whenever one is asked)."""
        asked = {d for d in (self.model, self.optimizer) if d is not None}
        return (kind == "optimizer" and stored.is_floating and planned == stored
                and bool(asked - {stored}))


@dataclass(frozen=True)
class KeptDtypes:
    """The optimizer tensors of one merge that kept their stored dtype though a cast was asked.

    Attributes:
        names: their output names. dtypes: the stored dtypes they kept (torch's names).
        counters: how many of them are step counters or scalars, which are never cast.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    counters: int

    @classmethod
    def of(cls, kept: Sequence[tuple[str, Sequence[int], DType]]) -> KeptDtypes | None:
        """From ``(name, shape, stored dtype)`` of each kept tensor; None when there are none."""
        if not kept:
            return None
        return cls(tuple(name for name, _, _ in kept),
                   tuple(dict.fromkeys(dtype.name for _, _, dtype in kept)),
                   sum(is_counter(name, shape) for name, shape, _ in kept))

    def describe(self) -> str:
        """The report's line: ``kept 12 optimizer tensors in float32 (...)``."""
        count = len(self.names)
        counters = ("; 1 step counter or scalar is never cast" if self.counters == 1 else
                    f"; {self.counters} step counters and scalars are never cast"
                    if self.counters else "")
        return (f"kept {count} optimizer tensor{'s' * (count != 1)} in "
                f"{', '.join(self.dtypes)} ({WHY_KEPT}{counters})")

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtypes": list(self.dtypes),
                "counters": self.counters, "why": WHY_KEPT}
