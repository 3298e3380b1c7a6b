"""Does a model (or optimizer) match a checkpoint? Answered from metadata, before loading."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdpckpt.dcp.reader import read_dcp_folder

__all__ = ["compare", "flatten", "mismatch_message"]


def _global_shape(value: Any) -> tuple[int, ...] | None:
    import torch

    if isinstance(value, torch.Tensor):
        return tuple(value.shape)  # DTensor and ShardedTensor report the global shape
    size = getattr(value, "size", None)
    return tuple(size()) if callable(size) else None


def compare(folder: Path, state: Mapping[str, Any], prefix: str) -> tuple[list, list, list]:
    metadata = read_dcp_folder(folder).metadata
    stored: dict[str, tuple[int, ...] | None] = {t.name: t.shape for t in metadata.tensors}
    stored.update({o.name: None for o in metadata.objects})
    missing, mismatched = [], []
    wanted = set()
    for key, value in state.items():
        name = f"{prefix}.{key}"
        wanted.add(name)
        shape = _global_shape(value)
        if name not in stored:
            missing.append(key)
        elif shape is not None and (have := stored[name]) is not None and tuple(have) != shape:
            mismatched.append(f"{key} (checkpoint {list(have)}, model {list(shape)})")
    unexpected = [n[len(prefix) + 1:] for n in stored if n not in wanted and
                  n.startswith(prefix + ".")]
    return missing, unexpected, mismatched


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flat names (``state.0.weight.exp_avg``) for a nested state dict."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(dict(state))[0]


def mismatch_message(folder: Path, missing: list, unexpected: list, mismatched: list) -> str:
    parts = []
    for label, items in (("missing from the checkpoint", missing),
                         ("not in the model", unexpected), ("shape differs", mismatched)):
        if items:
            shown = ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")
            parts.append(f"{len(items)} {label}: {shown}")
    return (f"{folder}: the model does not match the checkpoint; " + "; ".join(parts) +
            ". Nothing was loaded. Pass strict=False to load the keys that match.")
