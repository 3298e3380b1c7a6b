"""What convert is given: a file recognized by its content, or the model file of a folder.

A ``.safetensors`` file, a shard index, a ``torch.save`` archive (zip or legacy), locally or
on object storage; anything else is refused in one line naming what convert accepts.
"""

from __future__ import annotations

import struct
import zipfile

from fsdpckpt._io import storage
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._layout_names import MODEL_FILES  # what convert reads from a folder
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from fsdpckpt.formats._shards import read_shard_index

__all__ = ["MODEL_FILES", "first_line", "resolve_source", "shards", "sniff"]


#: What a model file may be, said after the verb that read it (``convert reads ...``).
_ACCEPTS = "reads a .safetensors file, a .bin/.pt file written by torch.save, or a shard " \
           "index (*.index.json)"
#: What a verb given a rank file is told to do instead of passing its folder.
_RANK_FILE_FIX = {"convert": "it is DCP already (convert makes DCP of a full file); to get a "
                             "full file from it: fsdpckpt merge {folder} OUT_DIR"}
# torch.save's legacy (non-zip) format starts by pickling this number.
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_ZIP_MAGIC = b"PK\x03\x04"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _head(file: Place) -> tuple[bytes, int, bool]:
    """The first 64 bytes of ``file``, its size, and whether it reads as a zip archive."""
    with storage.opened(file) as opened:
        first = bytearray(min(64, opened.size))
        opened.read_at(memoryview(first), 0)
        is_zip = first.startswith(_ZIP_MAGIC) and zipfile.is_zipfile(opened.file())
        return bytes(first), opened.size, is_zip


def sniff(file: Place, verb: str = "fsdpckpt") -> str:
    """``"safetensors"`` or ``"torch"`` (``"torch-legacy"`` for the pre-zip format), by content.

    ``verb`` names who reads it in the refusal (``"convert"``: "convert reads a ...").

    Raises:
        NotACheckpointError: neither format, or a rank file of a sharded checkpoint (which
            would read as a damaged torch.save archive); CorruptCheckpointError: a
            safetensors header that cannot be whole.
    """
    from fsdpckpt.dcp.layout import refuse_rank_file

    refuse_rank_file(file, fix=_RANK_FILE_FIX.get(verb, ""))
    head, size, is_zip = _head(file)
    if head.startswith(_ZIP_MAGIC):
        if not is_zip:  # torch.save's zip directory is written last
            raise CorruptCheckpointError(
                f"{file}: a torch.save archive without its zip directory at the end: it is "
                "truncated; download or save it again.")
        return "torch"
    if head.startswith(b"\x80") and _LEGACY_MAGIC in head[:32]:
        return "torch-legacy"
    if len(head) >= 9 and head[8:9] == b"{":
        (header,) = struct.unpack("<Q", head[:8])
        if 8 + header > size:
            raise CorruptCheckpointError(
                f"{file}: a safetensors file whose header says {8 + header} bytes, but the "
                f"file has {size}: it is truncated; download or merge it again.")
        return "safetensors"
    what = "the file is empty" if not head else "it holds text" if _is_text(head) else \
        "its first bytes match neither"
    raise NotACheckpointError(f"{file}: not a safetensors or torch.save file ({what}); "
                              f"{verb} {_ACCEPTS}.")


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def shards(path: Place, verb: str = "fsdpckpt") -> list[Place]:
    """The files to read: those a shard index lists, else ``path`` alone; each checked
    (``verb`` names the reader in a refusal, as for :func:`sniff`)."""
    if not path.name.endswith(".index.json"):
        return [path]
    files = read_shard_index(path, wording={
        "*": "{index}: not a shard index (a JSON file with a 'weight_map' of names to files: "
             "{detail}); " + f"{verb} {_ACCEPTS}."}).files
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"{file}: listed in {path.name} but missing; copy "
                                          "every shard beside the index.")
    return files


def resolve_source(source: Place) -> Place:
    """The file to convert: ``source`` itself, or the model file of a folder.

    A folder holding a merged or Hugging Face model stands for its model file (the first of
    :data:`MODEL_FILES` present, the order ``load_full_state_dict`` uses). A checkpoint
    folder is already DCP: the message points to ``merge``.
    """
    if not source.exists():
        raise CheckpointNotFoundError(f"{source}: no such file or folder; check the path.")
    if not source.is_dir():
        return source
    for name in MODEL_FILES:
        if (source / name).is_file():
            return source / name
    from fsdpckpt.dcp.layout import find_layout

    try:
        find_layout(source)
    except (CheckpointNotFoundError, NotACheckpointError):
        pass
    else:
        raise NotACheckpointError(
            f"{source}: is a DCP checkpoint already; convert turns a full .safetensors or "
            f".bin file into one. To get a full file from it: fsdpckpt merge {source} OUT_DIR")
    candidates = [name for name in storage.names(source) if (source / name).is_file() and
                  name.endswith((".safetensors", ".bin", ".pt", ".index.json"))]
    hint = f"; pass one of its files, e.g. {source / candidates[0]}" if candidates else \
        f"; convert {_ACCEPTS}"
    raise NotACheckpointError(f"{source}: is a folder without {' or '.join(MODEL_FILES[1::2])}"
                              f"{hint}.")
