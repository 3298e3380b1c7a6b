"""A sharded Hugging Face model's files, read and written in one place.

- :func:`read_shard_index` reads a ``*.index.json`` (``{"weight_map": {name: file}}``),
  local or on object storage, bounded in size and depth, and refuses a file name that
  leads out of the index's folder (``../x``, ``/abs``): an index may not send a reader
  elsewhere. Each caller words its own errors (its verb knows what to tell the user).
- :func:`index_document` / :func:`index_bytes` write one, as ``save_pretrained`` does.
- :func:`read_header` gives a safetensors file's checked header through
  :func:`fsdpckpt.dcp._hfstorage.parse_header` (the one parser), by ranged reads alike for
  a local file and a remote one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdpckpt._io import storage
from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.storage import OpenFile, Place
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.formats._base import TensorSpec

if TYPE_CHECKING:
    from fsdpckpt.dcp._hfstorage import SafetensorsHeader

__all__ = ["MAX_INDEX_BYTES", "ShardIndex", "read_shard_index", "index_document",
           "index_bytes", "read_header"]

#: A shard index is a small JSON file (a few MB for the largest models); a larger "index"
#: is refused before it is read.
MAX_INDEX_BYTES = 64 << 20

#: How :func:`read_shard_index` words a refusal: a template per kind of problem, formatted
#: with ``index`` (the file) and ``detail``; ``"*"`` for every kind not named. The kinds:
#: ``"size"`` (detail: its size), ``"json"`` (the parser's reason), ``"form"`` (what is
#: wrong with its shape), ``"outside"`` (the name, and why).
Wording = Mapping[str, str]

_WORDING: Wording = {"*": "{index}: not a shard index ({detail})"}


@dataclass(frozen=True)
class ShardIndex:
    """A shard index, read and checked.

    Attributes:
        path: the index file. weight_map: tensor name -> file name (inside its folder).
    """

    path: Place
    weight_map: dict[str, str]

    @property
    def names(self) -> list[str]:
        """The file names it lists, each once, in order of first mention."""
        return list(dict.fromkeys(self.weight_map.values()))

    @property
    def files(self) -> list[Place]:
        """The files it lists (beside the index), each once, in order of first mention."""
        return [self.path.parent / name for name in self.names]


def _leaves_folder(name: str) -> bool:
    # Shards lie beside their index (symlinks, as in the Hugging Face cache, are fine; a
    # subfolder too): an absolute name or a '..' segment reads elsewhere.
    return os.path.isabs(name) or name.startswith(("/", "\\")) or \
        ".." in re.split(r"[\\/]", name)


def _refusal(wording: Wording, kind: str, index: Place, detail: str) -> NotACheckpointError:
    template = wording.get(kind, wording.get("*", _WORDING["*"]))
    return NotACheckpointError(template.format(index=index, detail=detail))


def read_shard_index(index: Place, *, wording: Wording = _WORDING) -> ShardIndex:
    """Read the shard index ``index`` and check it.

    Args:
        wording: the caller's words for each problem (see :data:`Wording`).

    Raises:
        NotACheckpointError: worded by ``wording``: the file is over
            :data:`MAX_INDEX_BYTES`, is not JSON, has no ``weight_map`` object of names to
            non-empty file names, or names a file outside its folder.
        CheckpointNotFoundError: no such file.
    """
    def refuse(kind: str, detail: str) -> NotACheckpointError:
        return _refusal(wording, kind, index, detail)

    size = storage.size(index)
    if size > MAX_INDEX_BYTES:
        raise refuse("size", str(size))
    try:
        doc = parse_json(storage.read_bytes(index))
    except ValueError as exc:
        raise refuse("json", str(exc)) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise refuse("form", "no 'weight_map' object")
    if not all(isinstance(n, str) and n for n in weight_map.values()):
        raise refuse("form", "a file name is not a string")
    outside = [n for n in weight_map.values() if _leaves_folder(n)]
    if outside:
        raise refuse("outside", f"'{outside[0]}' lies outside the index's folder")
    return ShardIndex(index, {str(k): v for k, v in weight_map.items()})


def index_document(files: Iterable[tuple[str, Iterable[TensorSpec]]]) -> dict[str, Any]:
    """The index of the shards ``files`` (each file's name and tensors): ``metadata.
    total_size`` (the tensors' bytes) and the ``weight_map``, as Hugging Face writes it."""
    weight_map: dict[str, str] = {}
    total = 0
    for name, specs in files:
        for spec in specs:
            weight_map[spec.name] = name
            total += spec.nbytes
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def index_bytes(document: dict[str, Any]) -> bytes:
    """The bytes of an index file: indented JSON and a final newline."""
    return (json.dumps(document, indent=2) + "\n").encode()


def read_header(file: Place, opened: OpenFile | None = None) -> SafetensorsHeader:
    """The checked header of the safetensors file ``file``, by ranged reads of its first
    bytes (a local file through its descriptor, a remote one by ranged GETs); ``opened``:
    the file already open (for its tensors' bytes next), else it is opened and closed here.

    Raises:
        CorruptCheckpointError: the header is damaged or does not fit the file.
        CheckpointNotFoundError, NotACheckpointError: no such (regular) file.
    """
    from fsdpckpt.dcp._hfstorage import parse_header  # the read side's; a plan needs none

    if opened is not None:
        return parse_header(opened, opened.size, str(file))
    with storage.opened(file) as handle:
        return parse_header(handle, handle.size, str(file))
