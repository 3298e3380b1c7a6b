"""Finding a chunk's raw tensor bytes inside its ``.distcp`` file, without torch.

DCP writes each chunk as a complete ``torch.save`` zip archive at a byte offset
of a rank file. The archive stores its entries uncompressed: ``data.pkl`` (a
small pickle naming the dtype, shape and strides) and ``data/0`` (the raw
storage bytes). Knowing where ``data/0`` starts lets a merge copy bytes file to
file; knowing the strides tells when it cannot.
"""

from __future__ import annotations

import math
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, cast

from fsdpckpt import _torch
from fsdpckpt._printable import printable
from fsdpckpt.dcp._allowlist import BUILTIN_GLOBALS, brief
from fsdpckpt.dcp._plainzip import EndsRead
from fsdpckpt.dcp._safe_pickle import safe_loads
from fsdpckpt.dcp._ziparchive import (
    CHUNK_ENTRIES,
    CHUNK_PICKLE_BYTES,
    SliceFile,
    entry_info,
    open_archive,
    read_entry,
    zip_errors,
)
from fsdpckpt.dcp.dtypes import DTYPES, DType
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError

__all__ = ["RawTensor", "SliceFile", "check_view", "locate_tensor", "read_archive_pickle",
           "read_archive_with_tensors"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
#: The name the manifest's reader still imports.
_open_archive = open_archive


@dataclass(frozen=True)
class RawTensor:
    """Where one chunk's elements lie in its data file, and in what order.

    Attributes:
        storage_start: absolute byte offset of the storage (``data/0``) in the data file.
        storage_nbytes: byte length of the storage.
        dtype: element type.
        storage_offset: offset of the first element in the storage, in elements.
        shape: the tensor's shape.
        stride: the tensor's strides, in elements.
        crc32: the CRC-32 the archive records for the storage entry (None: nothing recorded).
        entry: the storage entry's name in its archive, for messages.
    """

    storage_start: int
    storage_nbytes: int
    dtype: DType
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    crc32: int | None = None
    entry: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """True when the elements are stored in row-major order without holes."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def data_start(self) -> int:
        """Absolute byte offset of the first element."""
        return self.storage_start + self.storage_offset * self.dtype.itemsize


class _Storage:
    """A storage a pickle refers to by persistent id, its byte size checked against the pid."""

    def __init__(self, dtype: DType | None, key: str, nbytes: int) -> None:
        self.dtype, self.key, self.nbytes = dtype, key, nbytes


class _TensorRecord:
    def __init__(self, storage: Any, offset: Any, shape: Any, stride: Any,
                 dtype: DType | None = None) -> None:
        self.storage, self.offset, self.shape, self.stride, self.dtype = (
            storage, offset, shape, stride, dtype)


class _StorageType:
    def __init__(self, dtype: DType | None) -> None:
        self.dtype = dtype


def _rebuild_v2(storage: Any, offset: Any, shape: Any, stride: Any, *_: Any) -> _TensorRecord:
    return _TensorRecord(storage, offset, shape, stride)


def _rebuild_v3(storage: Any, offset: Any, shape: Any, stride: Any, _grad: Any, _hooks: Any,
                dtype: Any, *_: Any) -> _TensorRecord:
    return _TensorRecord(storage, offset, shape, stride,
                         dtype if isinstance(dtype, DType) else None)


_STORAGE_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_torch.TORCH_MODULE, name): d for name, d in DTYPES.items()},
    _torch.UNTYPED_STORAGE: _StorageType(None),
    **{(_torch.TORCH_MODULE, d.storage_class): _StorageType(d) for d in DTYPES.values()
       if d.storage_class},
}

_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    **BUILTIN_GLOBALS,
    **_STORAGE_GLOBALS,
    _torch.REBUILD_TENSOR_V2: _rebuild_v2,
    _torch.REBUILD_TENSOR_V3: _rebuild_v3,
}


def is_plain_int(value: Any) -> bool:
    """An int that is not a bool (pickles give both; sizes and offsets are never bools)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _persistent_storage(pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
            and is_plain_int(pid[4]) and pid[4] >= 0):
        # The id is untrusted and may be huge (a 1 GB string): quoted bounded, never whole.
        raise NotACheckpointError(
            f"the archive's pickle names the persistent id {brief(pid, 200)}, where torch.save "
            "writes ('storage', storage type, key, location, size); the file is damaged or "
            "crafted.")
    dtype = pid[1].dtype
    # torch.save records a typed (legacy) storage's size in elements, an UntypedStorage's
    # (every dtype without a legacy class: uint16, float8, complex32...) in bytes.
    return _Storage(dtype, pid[2], pid[4] * dtype.itemsize if dtype else pid[4])


def _tensor_dtype(record: _TensorRecord, source: str) -> DType:
    dtype = record.dtype or record.storage.dtype
    if dtype is None:
        raise CorruptCheckpointError(f"{source}: the archive does not name its dtype.")
    return dtype


def check_view(dtype: DType, storage_nbytes: int, offset: Any, shape: Any, stride: Any, *,
               source: str) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Check that a tensor's storage offset, shape and strides stay inside its storage.

    torch refuses such a tensor when it loads it; a merge that trusted them would read
    bytes of the zip around the storage as values.

    Args:
        dtype: the element type.
        storage_nbytes: the bytes the storage really holds.
        offset, shape, stride: as the archive's pickle gives them (untrusted).
        source: how to name the tensor in messages.

    Returns:
        ``(offset, shape, stride)`` as plain ints and tuples.

    Raises:
        CorruptCheckpointError: naming ``source``, when any of them is not a
            non-negative integer, the ranks differ, or the view reaches outside the storage.
    """
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else shape
    stride = tuple(stride) if isinstance(stride, (tuple, list)) else stride
    if not (is_plain_int(offset) and isinstance(shape, tuple) and isinstance(stride, tuple)
            and all(map(is_plain_int, shape)) and all(map(is_plain_int, stride))):
        raise CorruptCheckpointError(f"{source}: the archive gives a storage offset, shape or "
                                     "strides that are not integers; the file is damaged.")
    if len(shape) != len(stride):
        raise CorruptCheckpointError(f"{source}: the archive gives {len(shape)} dims but "
                                     f"{len(stride)} strides; the file is damaged.")
    if offset < 0 or any(d < 0 for d in shape) or any(s < 0 for s in stride):
        raise CorruptCheckpointError(
            f"{source}: the archive gives a negative storage offset, size or stride "
            f"(offset {offset}, shape {list(shape)}, strides {list(stride)}); torch refuses "
            "such a tensor, the file is damaged.")
    capacity = storage_nbytes // dtype.itemsize
    # Python ints do not overflow, so the extent is exact however large the numbers.
    extent = sum((d - 1) * s for d, s in zip(shape, stride)) + 1 if all(shape) else 0
    if offset + extent > capacity or offset > capacity:
        raise CorruptCheckpointError(
            f"{source}: the tensor (offset {offset}, shape {list(shape)}, strides "
            f"{list(stride)}) reaches past its storage of {capacity} {dtype.name} elements; "
            "the file is damaged.")
    return offset, shape, stride


def _storage_entry(archive: zipfile.ZipFile, prefix: str, storage: _Storage, dtype: DType,
                   source: str) -> zipfile.ZipInfo:
    """The archive entry holding ``storage``, checked against the size the pickle declares."""
    try:
        data = archive.getinfo(f"{prefix}data/{storage.key}")
    except KeyError:
        raise CorruptCheckpointError(f"{source}: the archive lacks its storage entry.") from None
    if data.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{source}: the tensor data is compressed, which torch.save "
                                     "never does.")
    if data.file_size != storage.nbytes or storage.nbytes % dtype.itemsize:
        raise CorruptCheckpointError(
            f"{source}: storage holds {data.file_size} bytes, but the archive says "
            f"{storage.nbytes} bytes of {dtype.itemsize}-byte {dtype.name} elements.")
    return data


def _check_byteorder(archive: zipfile.ZipFile, prefix: str, source: str, start: int) -> None:
    try:
        info = archive.getinfo(f"{prefix}byteorder")
    except KeyError:
        return
    if read_entry(archive, info, source=source, start=start).strip() != b"little":
        raise CorruptCheckpointError(f"{source}: saved on a big-endian machine, which "
                                     "fsdpckpt does not convert; merge it there")


def read_archive_pickle(file: IO[bytes], start: int, length: int, *, source: str,
                        allowed: dict[tuple[str, str], Any], persistent: Any = None) -> Any:
    """Unpickle the ``data.pkl`` of the ``torch.save`` archive at ``start`` through an allowlist."""
    with open_archive(file, start, length, source) as archive:
        info = entry_info(archive, "/data.pkl", source)
        return safe_loads(read_entry(archive, info, source=source, start=start),
                          allowed=allowed, source=source,
                          persistent_load=persistent)


def read_archive_with_tensors(file: IO[bytes], start: int, length: int, *, source: str,
                              allowed: dict[tuple[str, str], Any],
                              make_tensor: Callable[[DType, bytes, int, tuple[int, ...],
                                                     tuple[int, ...]], Any]) -> Any:
    """Unpickle a ``torch.save`` archive whose value may hold tensors, without torch.

    Every tensor is decoded from the archive's own storage entries and handed to
    ``make_tensor(dtype, storage_bytes, storage_offset, shape, strides)``, whose result
    takes its place. Sizes the pickle declares are checked against the entries present
    before any storage is read, and each view against its storage, so a hostile or
    damaged archive can make this read no more than the archive's own bytes.

    Args:
        file, start, length: where the archive lies.
        source: how to name the entry in messages.
        allowed: the globals the value may name besides tensors and storages.
        make_tensor: builds the value standing for one tensor.

    Raises:
        UnsafePickleError: the pickle names a global outside ``allowed`` and the tensor ones.
        CorruptCheckpointError / NotACheckpointError: the archive is damaged.
    """
    with open_archive(file, start, length, source) as archive:
        pkl = entry_info(archive, "/data.pkl", source)
        prefix = pkl.filename[: -len("data.pkl")]
        _check_byteorder(archive, prefix, source, start)
        storages: dict[str, bytes] = {}

        def storage(pid: Any) -> _Storage:
            found = _persistent_storage(pid)
            # Checked now, before any byte of it is read: the entry must exist and be
            # exactly as large as the pickle says.
            _storage_entry(archive, prefix, found, found.dtype or DTYPES["uint8"], source)
            return found

        def rebuild(record: _TensorRecord) -> Any:
            if not isinstance(record.storage, _Storage):
                raise CorruptCheckpointError(f"{source}: a tensor has no storage.")
            dtype = _tensor_dtype(record, source)
            entry = _storage_entry(archive, prefix, record.storage, dtype, source)
            offset, shape, stride = check_view(dtype, entry.file_size, record.offset,
                                               record.shape, record.stride, source=source)
            if entry.filename not in storages:
                storages[entry.filename] = read_entry(archive, entry, source=source,
                                                      start=start)
            return make_tensor(dtype, storages[entry.filename], offset, shape, stride)

        globals_ = {
            **allowed,
            **_STORAGE_GLOBALS,
            _torch.REBUILD_TENSOR_V2: lambda *a: rebuild(_rebuild_v2(*a)),
            _torch.REBUILD_TENSOR_V3: lambda *a: rebuild(_rebuild_v3(*a)),
        }
        return safe_loads(read_entry(archive, pkl, source=source, start=start),
                          allowed=globals_, source=source,
                          persistent_load=storage)


#: Records of the chunk pickles read last, by their bytes: the chunks of one tensor (equal
#: shards of its rows) mostly pickle the same bytes, so a tensor in 4,096 chunks is
#: unpickled a few times, not 4,096. A record is only read, never changed; only a pickle
#: that unpickled without error is kept.
_RECORDS: dict[bytes, Any] = {}
_RECORDS_KEPT = 256
_RECORD_BYTES = 1024  # larger pickles are not kept: the cache stays under 256 KiB


def _tensor_record(data: bytes, source: str) -> Any:
    found = _RECORDS.get(data)
    if found is None:
        found = safe_loads(data, allowed=_TENSOR_GLOBALS, source=source,
                           persistent_load=_persistent_storage)
        if len(data) <= _RECORD_BYTES:
            if len(_RECORDS) >= _RECORDS_KEPT:
                _RECORDS.clear()
            _RECORDS[data] = found
    return found


def locate_tensor(file: IO[bytes] | int, start: int, length: int, *,
                  source: str) -> RawTensor:
    """Find the raw bytes of the tensor saved in the ``torch.save`` archive at ``start``.

    Args:
        file: the open data file, or its descriptor (read by ``pread``).
        start: byte offset of the archive in ``file``.
        length: byte length of the archive.
        source: how to name the chunk in messages (file and tensor).

    Returns:
        A :class:`RawTensor` giving the storage's absolute position, dtype, shape and strides.

    Raises:
        CorruptCheckpointError: the bytes are not such an archive, or disagree with themselves.
    """
    file = cast(IO[bytes], EndsRead(file, start, length))
    with open_archive(file, start, length, source, max_entries=CHUNK_ENTRIES,
                      plain=True) as archive:
        pkl = entry_info(archive, "/data.pkl", source, max_bytes=CHUNK_PICKLE_BYTES)
        record = _tensor_record(read_entry(archive, pkl, source=source, start=start), source)
        if not isinstance(record, _TensorRecord) or not isinstance(record.storage, _Storage):
            raise CorruptCheckpointError(f"{source}: the archive does not hold a single tensor.")
        prefix = pkl.filename[: -len("data.pkl")]
        _check_byteorder(archive, prefix, source, start)
        return locate_record(file, start, length, archive, prefix, record, source=source)


def locate_record(file: IO[bytes], start: int, length: int, archive: zipfile.ZipFile,
                  prefix: str, record: _TensorRecord, *, source: str) -> RawTensor:
    """Where the tensor a pickle's ``record`` describes lies in ``file``, no data read: its
    storage entry (checked against the size the pickle declares), its view (checked to fit
    that storage) and the entry's data offset.

    Raises:
        CorruptCheckpointError: the record has no storage, or disagrees with the archive.
    """
    if not isinstance(record.storage, _Storage):
        raise CorruptCheckpointError(f"{source}: a tensor has no storage.")
    dtype = _tensor_dtype(record, source)
    entry = _storage_entry(archive, prefix, record.storage, dtype, source)
    offset, shape, stride = check_view(dtype, entry.file_size, record.offset, record.shape,
                                       record.stride, source=source)
    data_start = entry_data_start(file, start, length, entry, source=source)
    return RawTensor(data_start, entry.file_size, dtype, offset, shape, stride, entry.CRC,
                     entry.filename)


def entry_data_start(file: IO[bytes], start: int, length: int, info: zipfile.ZipInfo, *,
                     source: str) -> int:
    """The absolute offset in ``file`` of the data of the zip entry ``info`` of the archive
    at ``start``: past its local header, whose name and extra fields may differ in length
    from the central directory's.

    Raises:
        CorruptCheckpointError: the local header is damaged, or the data reaches past the
            archive.
    """
    at = start + info.header_offset
    with zip_errors(source, lambda: f"the header of its entry '{printable(info.filename)}' "
                    f"(bytes {at}-{at + 30})"):
        file.seek(at)
        header = file.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{source}: the zip header of '{printable(info.filename)}' "
                                     f"(bytes {at}-{at + 30}) is damaged.")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[1:]
    data_start = at + _LOCAL_HEADER.size + name_len + extra_len
    if data_start + info.file_size > start + length:
        name = printable(info.filename)
        raise CorruptCheckpointError(
            f"{source}: the data of '{name}' (bytes {data_start}-"
            f"{data_start + info.file_size}) reaches past its archive (bytes {start}-"
            f"{start + length}); the file is damaged.")
    return data_start
