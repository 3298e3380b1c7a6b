"""The names ``save_pretrained`` writes the weights under: the hub's, as export-hf's.

transformers 5 holds some weights under other names and shapes than its hub files (fused
MoE experts, LLaVA's ``model.language_model.*``); export-hf writes what transformers' own
``save_pretrained`` writes, each hub tensor a box of one stored tensor
(:mod:`fsdpckpt.export._moe`). :func:`hub_layout` asks the same questions export-hf asks,
with its own functions (the config's model class built on the meta device,
:func:`~fsdpckpt.export._model.expect_model`; :func:`~fsdpckpt.export._moe.hub_names`), of
the model's names and shapes, so both write the same names in the same order. The plan
(:func:`~fsdpckpt.training._save_plan.plan_save`) turns each piece into an output tensor of
its own, the intersection of this rank's boxes with the piece's box written by this rank.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt.export._config import CONFIG, config_bytes
from fsdpckpt.export._model import ModelExpectation, expect_model
from fsdpckpt.export._moe import Piece, hub_names

__all__ = ["Hub", "hub_layout"]


@dataclass(frozen=True)
class Hub:
    """What export-hf would write for these names.

    Attributes:
        pieces: each name (as stored: the model's state dict, cleaned) -> the pieces it is
            written as; None: every name as stored.
        tied: tied targets -> their sources, as the model class ties them; None when the
            class was not built (then the config alone decides, as export-hf).
        as_stored: why the names are written as stored (export-hf's ``names_as_stored``),
            None when they are the hub's.
    """

    pieces: dict[str, tuple[Piece, ...]] | None
    tied: dict[str, str] | None
    as_stored: str | None


def hub_layout(config: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Hub:
    """The hub's names for a model's tensors, as export-hf finds them.

    Args:
        config: the config written beside the weights (``exported_config``'s).
        shapes: every tensor's name (cleaned, tied targets too) and shape, in saving order.

    Returns:
        The :class:`Hub`. Where the names do not match the config's model class (a model
        that is not the class its config names), they are written as stored, and it says
        why: export-hf would refuse such a checkpoint, there is no export to agree with.
    """
    # export-hf builds the class from the staged config folder: the same from a scratch one
    # (custom code is never run: trust_remote_code stays False, and then it says why).
    with tempfile.TemporaryDirectory(prefix="fsdpckpt-config-") as folder:
        (Path(folder) / CONFIG).write_bytes(config_bytes(config))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expect = expect_model(Path(folder), config)
    if not isinstance(expect, ModelExpectation):
        return Hub(None, None, f"the model class was not built: {expect}")
    saved = expect.saved if isinstance(expect.saved, dict) else None
    names = hub_names(shapes, expect.shapes, expect.tied, saved)
    if names.problems:
        return Hub(None, None, f"the model's names do not match {expect.model_class}: "
                   + "; ".join(names.problems))
    grouped: dict[str, list[Piece]] = {}
    for piece in names.pieces:
        grouped.setdefault(piece.source, []).append(piece)
    as_stored = (str(expect.saved) or None) if saved is None else None
    return Hub({k: tuple(v) for k, v in grouped.items()}, names.tied, as_stored)
