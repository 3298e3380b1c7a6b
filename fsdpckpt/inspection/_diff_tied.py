"""An export's tied keys, for ``diff``.

``export-hf`` leaves a tied target out (``lm_head.weight`` when the config ties the word
embeddings): the loader makes it the tensor it is tied to. So a diff of a checkpoint
against its export would find ``lm_head.weight`` missing. A side that is a Hugging Face
folder (its weight file has a ``config.json`` beside it) ties what ``export-hf`` ties, by
the same rule (:func:`fsdpckpt.export._model.tied_without_transformers`), and the other
side's target is compared with this side's tied source, as a loader would see it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.export._config import CONFIG, read_config
from fsdpckpt.export._model import tied_without_transformers
from fsdpckpt.inspection._diff_sources import Source

__all__ = ["Tie", "ties_left_out", "side_config"]


@dataclass(frozen=True)
class Tie:
    """A tensor one side leaves out because its config ties it to another.

    Attributes:
        name: the target (``lm_head.weight``), present on the other side.
        tied_to: the tensor it is tied to (``model.embed_tokens.weight``), on this side.
        left_out_by: ``"a"`` or ``"b"``, the side whose config ties it.
    """

    name: str
    tied_to: str
    left_out_by: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tied_to": self.tied_to, "left_out_by": self.left_out_by}


def ties_left_out(side: Source, other: Collection[str], which: str) -> list[Tie]:
    """The targets ``side`` leaves out and its config ties, where the ``other`` side's
    tensor names hold them: none for a checkpoint (DCP) side, or a file with no readable
    ``config.json`` beside it.

    Args:
        side: one side of the diff.
        other: the tensor names of the other side.
        which: ``"a"`` or ``"b"``, the name of ``side`` in the report.

    Returns:
        One :class:`Tie` per target, with the tensor of ``side`` to compare it with.

    Example:
        >>> ties_left_out(export_side, checkpoint_side.tensors, "b")
        [Tie(name='lm_head.weight', tied_to='model.embed_tokens.weight', left_out_by='b')]
    """
    found = side_config(side)
    if found is None:
        return []
    _, config = found
    ties = tied_without_transformers(config, set(side.tensors) | set(other))
    return [Tie(target, source, which) for target, source in ties.items()
            if target not in side.tensors and target in other and source in side.tensors]


def side_config(side: Source) -> tuple[Place, dict[str, Any]] | None:
    """The ``config.json`` beside a side's weight file and what it says: None for a
    checkpoint (DCP) side, or a file with no readable model config beside it.

    Example:
        >>> side_config(export_side)
        (PosixPath('out/config.json'), {'model_type': 'llama', ...})
    """
    if side.kind == "dcp":
        return None
    config_file = side.path.parent / CONFIG
    if not config_file.is_file():
        return None
    try:
        return config_file, read_config(config_file)
    except NotACheckpointError:  # not a model's config: nothing is known of its model
        return None
