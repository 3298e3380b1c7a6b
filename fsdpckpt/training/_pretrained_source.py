"""The weights of a Hugging Face folder or file for ``load_pretrained``: found, checked, open.

A source is a folder (its ``model.safetensors.index.json``, ``model.safetensors``,
``pytorch_model.bin.index.json`` or ``pytorch_model.bin``, the first there, the order every
reader of merged outputs uses) or one of those files, local or on object storage. Every rank
reads every header (a few MB at most) and no tensor byte: :func:`read_source` gives each
weight's name and where its elements lie (a :class:`~fsdpckpt.dcp._archive.RawTensor`).

Bytes are checked as every read path of fsdpckpt checks them. safetensors records no
checksum, so its header is checked strictly (:func:`~fsdpckpt.dcp._hfstorage.parse_header`,
plus what safetensors' own loader asks: the tensors' bytes follow one another from the start
of the data to the end of the file, so a truncated or appended file is refused). A ``.bin``
is a ``torch.save`` zip read by fsdpckpt's restricted unpickler (never ``torch.load``), and
each storage entry a rank reads from is checked whole against the CRC-32 the zip records
(:func:`verify`), before any parameter changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.rawio import ReadAt
from fsdpckpt._io.storage import OpenFile, Place
from fsdpckpt.dcp import _checked
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._perrank_file import read_rank
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from fsdpckpt.formats._shards import ShardIndex, read_header, read_shard_index
from fsdpckpt.merging._convert_source import MODEL_FILES, sniff

__all__ = ["Stored", "OpenFiles", "read_source", "read_weights", "verify"]

_ACCEPTS = ("load_pretrained reads a Hugging Face model folder or one of its weight files: "
            "model.safetensors, pytorch_model.bin, or their *.index.json")


@dataclass(frozen=True)
class Stored:
    """One weight of the source: the file holding it and where its elements lie there
    (``raw.crc32``: the CRC-32 its ``.bin`` entry records; None for safetensors)."""

    file: Place
    raw: RawTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw.shape)


def _weight_files(root: Place) -> tuple[list[Place], ShardIndex | None]:
    """The weight files of ``root`` (a folder or a file), each checked to exist, and the
    shard index that lists them, if any.

    Raises:
        CheckpointNotFoundError: ``root`` or a file its index lists is missing.
        NotACheckpointError: a folder holding no weights, or an index that is not one.
    """
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such file or folder; {_ACCEPTS}.")
    if root.is_dir():
        found = next((root / n for n in MODEL_FILES if (root / n).is_file()), None)
        if found is None:
            raise NotACheckpointError(f"{root}: holds no {' or '.join(MODEL_FILES)}; "
                                      f"{_ACCEPTS}.")
        root = found
    if not root.name.endswith(".index.json"):
        return [root], None
    index = read_shard_index(root, wording={"*": "{index}: not a shard index ({detail}); "
                                                  + _ACCEPTS + "."})
    for file in index.files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"{file}: listed in {root.name} but missing; "
                                          "download every shard beside the index.")
    return index.files, index


def _safetensors(file: Place) -> dict[str, Stored]:
    with storage.opened(file) as opened:
        header = read_header(file, opened)
    # As safetensors' own loader: the tensors tile the data section exactly, in some order.
    at = 0
    for begin, end in sorted((b, e) for _, _, b, e in header.tensors.values()):
        if begin != at:
            raise CorruptCheckpointError(f"{file}: data bytes {at}-{begin} belong to no tensor "
                                         "(safetensors' loader refuses such a file); the "
                                         "header is damaged or the file was changed; "
                                         "download it again.")
        at = end
    if at != header.data_size:
        raise CorruptCheckpointError(f"{file}: holds {header.data_size - at} bytes after its "
                                     "last tensor (safetensors' loader refuses such a file); "
                                     "it was appended to or damaged; download it again.")
    found = {}
    for name, (dtype, shape, begin, end) in header.tensors.items():
        strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        found[name] = Stored(file, RawTensor(header.data_start + begin, end - begin, dtype, 0,
                                             shape, strides))
    return found


def _torch_bin(file: Place) -> dict[str, Stored]:
    # The real folder: a Hugging Face cache links each file to a blob elsewhere, and the
    # rank-file reader only opens a file inside the folder it is given.
    real = storage.resolved(file)
    tensors, _, sharded = read_rank(real.parent, real.name)
    if sharded:
        raise NotACheckpointError(f"{file}: holds DTensors or ShardedTensors, a sharded "
                                  f"checkpoint rather than a model's weights; {_ACCEPTS} (a "
                                  "sharded checkpoint loads with load_state).")
    return {".".join(map(str, path)): Stored(file, pieces[0].raw)
            for path, pieces in tensors.items()}


def read_weights(file: Place) -> dict[str, Stored]:
    """Every tensor of one weight file (a safetensors file or a ``torch.save`` zip), by its
    name, the file checked as the module docstring says (no tensor byte is read). Also what
    ``verify`` reads a model folder's files with.

    Raises:
        CorruptCheckpointError: the file is damaged or truncated.
        NotACheckpointError: neither format, the legacy ``torch.save`` format, or sharded
            tensors (DTensors).
        UnsafePickleError: a ``.bin`` pickle asks for anything but tensors.

    Example:
        >>> sorted(read_weights(Path("out/model.safetensors")))[:1]
        ['lm_head.weight']
    """
    kind = sniff(file)
    if kind == "torch-legacy":
        raise NotACheckpointError(f"{file}: a torch.save file in the legacy (pre-zip) "
                                  "format, which records no checksum and cannot be read "
                                  "by ranges; save it again with torch.save or as "
                                  "safetensors.")
    return _safetensors(file) if kind == "safetensors" else _torch_bin(file)


def read_source(root: Place) -> dict[str, Stored]:
    """Every weight of the source ``root``, by its name, its file checked as the module
    docstring says (headers and pickles only: no tensor byte is read).

    Raises:
        CorruptCheckpointError: a file is damaged or truncated, or its index names a
            weight its file lacks or two files hold one weight.
        NotACheckpointError, CheckpointNotFoundError: no weights there.
        UnsafePickleError: a ``.bin`` pickle asks for anything but tensors.
    """
    files, index = _weight_files(root)
    found: dict[str, Stored] = {}
    for file in files:
        for name, stored in read_weights(file).items():
            if name in found:
                raise CorruptCheckpointError(f"{file}: holds '{name}', which "
                                             f"{found[name].file} holds too; the folder mixes "
                                             "two saves.")
            found[name] = stored
    for name, file_name in (index.weight_map if index is not None else {}).items():
        if name not in found:
            raise CorruptCheckpointError(f"{root}: its index lists '{name}' in {file_name}, "
                                         "which lacks it; the shards come from another save, "
                                         "download them again.")
    return found


@dataclass
class OpenFiles:
    """The source files a rank reads from, each opened once and closed at the end, and the
    ``.bin`` entries already checked against their CRC-32."""

    checked: set[Any] = field(default_factory=set)
    _open: dict[str, OpenFile] = field(default_factory=dict)

    def src(self, file: Place) -> int | ReadAt:
        """What offset reads of ``file`` take (a descriptor, or the remote file)."""
        key = str(file)
        if key not in self._open:
            self._open[key] = storage.open_file(file)
        return storage.descriptor(self._open[key])

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 trace: TracebackType | None) -> None:
        for opened in self._open.values():
            opened.close()
        self._open.clear()


def verify(files: OpenFiles, stored: Stored) -> None:
    """Check the whole storage entry ``stored`` lies in against its recorded CRC-32, once
    per entry, reading it in bounded blocks; nothing for safetensors (nothing recorded).

    Raises:
        ChecksumError: naming the file and the entry.
    """
    raw = stored.raw
    _checked.verify_entry_once(files.checked, (str(stored.file), raw.storage_start),
                               files.src(stored.file), raw.storage_start, raw.storage_nbytes,
                               raw.crc32, source=str(stored.file), entry=raw.entry)
