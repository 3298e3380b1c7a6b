"""Does a model (or optimizer) match a checkpoint? Answered from metadata, before loading."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fsdpckpt import _torch
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.reader import read_dcp_folder

__all__ = ["Comparison", "ShapeMismatch", "compare", "flatten", "mismatch_message",
           "without_options_it_lacks"]


@dataclass(frozen=True)
class ShapeMismatch:
    """A key both sides hold, with different global shapes."""

    key: str
    checkpoint: tuple[int, ...]
    model: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.key} (checkpoint {list(self.checkpoint)}, model {list(self.model)})"


@dataclass(frozen=True)
class Comparison:
    """How a state dict differs from a checkpoint, key by key (keys without the prefix).

    Attributes:
        missing: keys of the state dict the checkpoint lacks.
        unexpected: keys of the checkpoint the state dict lacks.
        mismatched: keys both hold, with different shapes.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[ShapeMismatch] = field(default_factory=list)

    def __bool__(self) -> bool:
        """True when they differ at all."""
        return bool(self.missing or self.unexpected or self.mismatched)

    @property
    def unloadable(self) -> list[str]:
        """The state dict's keys that cannot be loaded: missing, or shaped differently."""
        return self.missing + [m.key for m in self.mismatched]


def _global_shape(value: Any) -> tuple[int, ...] | None:
    import torch

    if isinstance(value, torch.Tensor):
        return tuple(value.shape)  # DTensor and ShardedTensor report the global shape
    size = getattr(value, "size", None)
    return tuple(size()) if callable(size) else None


def compare(folder: Place, state: Mapping[str, Any], prefix: str) -> Comparison:
    """Compare ``state`` with the entries under ``prefix.`` of the DCP folder ``folder``."""
    metadata = read_dcp_folder(folder).metadata
    stored: dict[str, tuple[int, ...] | None] = {t.name: t.shape for t in metadata.tensors}
    stored.update({o.name: None for o in metadata.objects})
    result = Comparison()
    wanted = set()
    for key, value in state.items():
        name = f"{prefix}.{key}"
        wanted.add(name)
        shape = _global_shape(value)
        if name not in stored:
            result.missing.append(key)
        elif shape is not None and (have := stored[name]) is not None and tuple(have) != shape:
            result.mismatched.append(ShapeMismatch(key, tuple(have), shape))
    result.unexpected.extend(n[len(prefix) + 1:] for n in stored if n not in wanted and
                             n.startswith(prefix + "."))
    return result


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flat names (``state.0.weight.exp_avg``) for a nested state dict."""
    return _torch.flatten_state_dict(dict(state))[0]


def without_options_it_lacks(state: dict[str, Any], comparison: Comparison) -> Comparison:
    """Leave out of ``state`` (an optimizer's, as ``get_optimizer_state_dict`` gives it) the
    param-group options the checkpoint lacks; return ``comparison`` without them.

    A newer torch adds options (AdamW's ``decoupled_weight_decay``, 2.7): a checkpoint an
    older torch wrote lacks them. Loaded without them, the optimizer's ``__setstate__`` sets
    its defaults, as torch's own ``Optimizer.load_state_dict`` of an older state dict does.
    Per-parameter state and ``params`` are never left out.
    """
    groups = state.get("param_groups") or []
    still: list[str] = []
    for key in comparison.missing:
        where, _, option = key.rpartition(".")
        head, _, index = where.partition(".")
        group = groups[int(index)] if head == "param_groups" and index.isdigit() and \
            int(index) < len(groups) else None
        if group is not None and option != "params" and option in group:
            del group[option]
        else:
            still.append(key)
    return replace(comparison, missing=still)


def mismatch_message(folder: Place, comparison: Comparison, what: str = "model") -> str:
    """One message saying how ``what`` (``"model"``, ``"optimizer"``) differs from ``folder``."""
    parts = []
    for label, items in (("missing from the checkpoint", comparison.missing),
                         (f"not in the {what}", comparison.unexpected),
                         ("shape differs", comparison.mismatched)):
        if items:
            shown = ", ".join(str(i) for i in items[:5]) + \
                (f" and {len(items) - 5} more" if len(items) > 5 else "")
            parts.append(f"{len(items)} {label}: {shown}")
    return (f"{folder}: the {what} does not match the checkpoint; " + "; ".join(parts) +
            ". Nothing was loaded. Pass strict=False to load the keys that match.")
