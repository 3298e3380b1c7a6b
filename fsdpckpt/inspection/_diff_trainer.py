"""A trainer's folder against a file holding its whole state, for ``diff``.

A trainer's single DCP folder (Lightning's ``*.ckpt/``, torchtune's ``dist_epoch_N/``,
torchtitan's ``step-N/``) is one side of a diff as its model part (or, with ``optimizer``,
its optimizer part), as ``merge`` writes them. Lightning's own ``consolidate_checkpoint``
writes one ``torch.save`` file of the whole folder with ``meta.pt``'s entries at the top
level (:func:`fsdpckpt.dcp._trainers.with_trainer_meta`); ``dcp_to_torch_save`` writes the
whole folder. When the other side holds every top-level key of the folder (``model.*`` and
``optimizer_0.*``...), the folder is compared whole instead: :class:`WholeTrainerSource`,
the folder's entries streamed as any DCP side's, and ``meta.pt``'s entries (decoded through
the allowlist, small) held in memory, all named together as that file's flattened entries
are named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._trainers import trainer_meta, trainer_of
from fsdpckpt.inspection._diff_files import read_value_box, value_info
from fsdpckpt.inspection._diff_sources import DcpSource, Source, TensorInfo, _names
from fsdpckpt.inspection._diff_tiles import Piece

__all__ = ["WholeTrainerSource", "whole_trainer_sides"]


class WholeTrainerSource(DcpSource):
    """A trainer's folder read whole, as its framework consolidates it: the DCP entries,
    less those a ``meta.pt`` entry of the same top-level key replaces, and ``meta.pt``'s
    entries. Names are given to both together, as a ``torch.save`` of that dict is named."""

    def __init__(self, path: Place, *, keep_keys: bool) -> None:
        import torch

        from fsdpckpt._torch import flatten_state_dict

        meta = trainer_meta(path) or {}  # refused (nothing run) before any tensor is read
        super().__init__(path, keep_keys=keep_keys, name=path.name)  # its own name: whole
        try:
            kept = [(old, e) for old, e in self._entries.items()
                    if not e.key_path or e.key_path[0] not in meta]
            flat, mapping = flatten_state_dict(meta)
            names = _names([e.key_path for _, e in kept] + [tuple(mapping[f]) for f in flat],
                           keep_keys=keep_keys, source=path)
            own = self.tensors
            self._entries = {new: e for new, (_, e) in zip(names, kept)}
            self.tensors = {new: TensorInfo(new, own[old].dtype, own[old].shape)
                            for new, (old, _) in zip(names, kept) if old in own}
            self._values = dict(zip(names[len(kept):], flat.values()))
            self.tensors.update({n: value_info(path, n, v) for n, v in self._values.items()
                                 if isinstance(v, torch.Tensor)})
        except BaseException:
            self.close()
            raise

    def object_names(self) -> list[str]:
        return super().object_names() + [n for n in self._values if n not in self.tensors]

    def objects(self) -> dict[str, Any]:
        found = super().objects()
        found.update({n: v for n, v in self._values.items() if n not in self.tensors})
        return found

    def pieces(self, name: str) -> list[Piece] | None:
        return None if name in self._values else super().pieces(name)

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        if name in self._values:
            read_value_box(self._values[name], offsets, sizes, out)
        else:
            super().read(name, offsets, sizes, out)


def _holds_whole(side: Source, other: Source) -> bool:
    """Whether ``side`` is a trainer's folder read as a part and ``other``, a file, holds
    every top-level key the folder stores."""
    if side.kind != "dcp" or other.kind == "dcp" or not trainer_of(side.path):
        return False
    from fsdpckpt.dcp.parts import open_part

    meta = open_part(side.path, side.path.name).metadata
    tops = {str(e.key_path[0]) for e in list(meta.tensors) + list(meta.objects) if e.key_path}
    names = list(other.tensors) + other.object_names()
    return bool(tops) and all(any(n == top or n.startswith(top + ".") for n in names)
                              for top in tops)


@contextlib.contextmanager
def whole_trainer_sides(left: Source, right: Source, *,
                        keep_keys: bool) -> Iterator[tuple[Source, Source]]:
    """``(left, right)``, with a side that is a trainer's folder read whole
    (:class:`WholeTrainerSource`) where the other side holds its whole state; a side
    replaced here is closed on exit (the caller closes the ones it opened).

    Example:
        >>> with whole_trainer_sides(folder_side, consolidated_side, keep_keys=False) as (a, b):
        ...     sorted(a.tensors)[:1]
        ['model.net.0.bias']
    """
    opened: list[Source] = []
    try:
        sides = []
        for side, other in ((left, right), (right, left)):
            if _holds_whole(side, other):
                side = WholeTrainerSource(side.path, keep_keys=keep_keys)
                opened.append(side)
            sides.append(side)
        yield sides[0], sides[1]
    finally:
        for side in opened:
            side.close()
