"""Finding a chunk's raw tensor bytes inside its ``.distcp`` file, without torch.

DCP writes each chunk as a complete ``torch.save`` zip archive at a byte offset
of a rank file. The archive stores its entries uncompressed: ``data.pkl`` (a
small pickle naming the dtype, shape and strides) and ``data/0`` (the raw
storage bytes). Knowing where ``data/0`` starts lets a merge copy bytes file to
file; knowing the strides tells when it cannot.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import IO, Any

from .dtypes import DTYPES, DType
from .errors import CorruptCheckpointError, NotACheckpointError
from .safe_pickle import BUILTIN_GLOBALS, safe_loads

__all__ = ["RawTensor", "SliceFile", "locate_tensor", "read_archive_pickle"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


class SliceFile(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``file`` starting at ``start``."""

    def __init__(self, file: IO[bytes], start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        self._file.seek(self._start + self._pos)
        data = self._file.read(count)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


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
    """

    storage_start: int
    storage_nbytes: int
    dtype: DType
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

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
    def __init__(self, dtype: DType | None, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorRecord:
    def __init__(self, storage: Any, offset: Any, shape: Any, stride: Any,
                 dtype: DType | None = None) -> None:
        self.storage, self.offset, self.shape, self.stride, self.dtype = (
            storage, offset, tuple(shape), tuple(stride), dtype)


class _StorageType:
    def __init__(self, dtype: DType | None) -> None:
        self.dtype = dtype


def _rebuild_v2(storage: Any, offset: Any, shape: Any, stride: Any, *_: Any) -> _TensorRecord:
    return _TensorRecord(storage, offset, shape, stride)


def _rebuild_v3(storage: Any, offset: Any, shape: Any, stride: Any, _grad: Any, _hooks: Any,
                dtype: Any, *_: Any) -> _TensorRecord:
    return _TensorRecord(storage, offset, shape, stride, dtype if isinstance(dtype, DType) else None)


_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    **BUILTIN_GLOBALS,
    **{("torch", name): d for name, d in DTYPES.items()},
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    **{("torch", d.storage_class): _StorageType(d) for d in DTYPES.values() if d.storage_class},
}


def _persistent_storage(pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)):
        raise NotACheckpointError(f"unexpected persistent id {pid!r}")
    return _Storage(pid[1].dtype, str(pid[2]), int(pid[4]))


def _open_archive(file: IO[bytes], start: int, length: int, source: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(SliceFile(file, start, length))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{source}: the bytes at offset {start} (length {length}) are not a torch.save "
            f"archive ({exc}); the file is damaged or was overwritten."
        ) from exc


def _entry(archive: zipfile.ZipFile, suffix: str, source: str) -> zipfile.ZipInfo:
    for info in archive.infolist():
        if info.filename.endswith(suffix):
            return info
    raise CorruptCheckpointError(f"{source}: the archive has no '*{suffix}' entry.")


def read_archive_pickle(file: IO[bytes], start: int, length: int, *, source: str,
                        allowed: dict[tuple[str, str], Any], persistent: Any = None) -> Any:
    """Unpickle the ``data.pkl`` of the ``torch.save`` archive at ``start`` through an allowlist."""
    with _open_archive(file, start, length, source) as archive:
        info = _entry(archive, "/data.pkl", source)
        return safe_loads(archive.read(info), allowed=allowed, source=source,
                          persistent_load=persistent)


def locate_tensor(file: IO[bytes], start: int, length: int, *, source: str) -> RawTensor:
    """Find the raw bytes of the tensor saved in the ``torch.save`` archive at ``start``.

    Args:
        file: the open data file.
        start: byte offset of the archive in ``file``.
        length: byte length of the archive.
        source: how to name the chunk in messages (file and tensor).

    Returns:
        A :class:`RawTensor` giving the storage's absolute position, dtype, shape and strides.

    Raises:
        CorruptCheckpointError: the bytes are not such an archive, or disagree with themselves.
    """
    with _open_archive(file, start, length, source) as archive:
        pkl = _entry(archive, "/data.pkl", source)
        record = safe_loads(archive.read(pkl), allowed=_TENSOR_GLOBALS, source=source,
                            persistent_load=_persistent_storage)
        if not isinstance(record, _TensorRecord) or not isinstance(record.storage, _Storage):
            raise CorruptCheckpointError(f"{source}: the archive does not hold a single tensor.")
        prefix = pkl.filename[: -len("data.pkl")]
        if f"{prefix}byteorder" in archive.namelist() and \
                archive.read(f"{prefix}byteorder").strip() != b"little":
            raise CorruptCheckpointError(f"{source}: saved on a big-endian machine, which "
                                         "fsdpckpt does not convert; merge it there")
        try:
            data = archive.getinfo(f"{prefix}data/{record.storage.key}")
        except KeyError:
            raise CorruptCheckpointError(f"{source}: the archive lacks its storage entry.") from None
    dtype = record.dtype or record.storage.dtype
    if dtype is None:
        raise CorruptCheckpointError(f"{source}: the archive does not name its dtype.")
    if data.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{source}: the tensor data is compressed, which torch.save "
                                     "never does.")
    if data.file_size != record.storage.numel * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{source}: storage holds {data.file_size} bytes, but the archive says "
            f"{record.storage.numel} x {dtype.itemsize}-byte elements.")
    file.seek(start + data.header_offset)
    header = file.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{source}: a zip entry header is damaged.")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[1:]
    storage_start = start + data.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    raw = RawTensor(storage_start, data.file_size, dtype, int(record.offset), record.shape,
                    record.stride)
    extent = sum((s - 1) * st for s, st in zip(raw.shape, raw.stride)) + 1 if all(raw.shape) else 0
    if (raw.storage_offset + extent) * dtype.itemsize > raw.storage_nbytes or \
            storage_start + raw.storage_nbytes > start + length:
        raise CorruptCheckpointError(f"{source}: the tensor reaches past its storage.")
    return raw
