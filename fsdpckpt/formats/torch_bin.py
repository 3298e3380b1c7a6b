"""``pytorch_model.bin``: a ``torch.save`` zip archive, written as a stream without torch.

The archive holds ``archive/data.pkl`` (the nested state dict, tensors as
references to storages), ``archive/byteorder``, one stored (uncompressed)
entry ``archive/data/{i}`` per tensor with its data aligned to 64 bytes as
torch aligns it, and ``archive/version``. Every entry's size is known from the
metadata, so every offset is fixed before data is copied; CRC-32s and the
central directory are written at the end by :meth:`TorchBinFormat.finish`.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from fsdpckpt._io.checksums import crc32
from fsdpckpt._io.rawio import pwrite_all
from fsdpckpt._torch import REBUILD_TENSOR_V2, REBUILD_TENSOR_V3, PurePythonPickler
from fsdpckpt.dcp._nesting import unflatten
from fsdpckpt.dcp._objects import TensorValue
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.formats._base import FileLayout, ObjectValue, OutputFormat, TensorSpec

__all__ = ["TorchBinFormat", "pickle_state_dict"]

_ALIGN = 64
_U32 = 0xFFFFFFFF
_PREFIX = "archive/"


class _Global:
    """A reference to ``module.name``, pickled as a GLOBAL without importing the module."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle wants reduce functions to be callable
        raise TypeError(f"{self.module}.{self.name} is a stand-in, not callable")


class _Storage:
    def __init__(self, key: str, dtype: DType, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...],
                 stride: tuple[int, ...] | None = None, offset: int = 0) -> None:
        self.storage, self.shape, self.offset = storage, shape, offset
        self.stride = _contiguous_stride(shape) if stride is None else stride


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for dim in reversed(shape):
        stride.append(step)
        step *= max(dim, 1)
    return tuple(reversed(stride))


# pickle's pure-Python pickler (from the compat module), whose dispatch table this subclass
# extends.
_BASE: Any = PurePythonPickler


class _Pickler(_BASE):
    """torch.save's pickle (protocol 2): tensors as ``_rebuild_tensor_v2/v3`` of a persistent
    storage."""

    dispatch = dict(_BASE.dispatch)

    def save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def save_tensor(self, obj: _Tensor) -> None:
        storage, stride = obj.storage, obj.stride
        hooks = collections.OrderedDict()  # type: ignore[var-annotated]
        if storage.dtype.storage_class:
            func = _Global(*REBUILD_TENSOR_V2)
            args: tuple[Any, ...] = (storage, obj.offset, obj.shape, stride, False, hooks)
        else:  # dtypes without a legacy typed storage (float8, uint16...) name their dtype
            func = _Global(*REBUILD_TENSOR_V3)
            args = (storage, obj.offset, obj.shape, stride, False, hooks,
                    _Global("torch", storage.dtype.name))
        self.save_reduce(func, args, obj=obj)

    def save_tensor_value(self, obj: TensorValue) -> None:
        # A tensor inside a non-tensor entry (a tensor hyperparameter): its storage
        # becomes one more data/{key} entry of the archive, its view stays as stored.
        key = str(self.first_extra_key + len(self.extra_storages))
        self.extra_storages.append((key, obj.storage))
        storage = _Storage(key, obj.dtype, len(obj.storage) // obj.dtype.itemsize)
        self.save_tensor(_Tensor(storage, obj.shape, obj.stride, obj.storage_offset))

    dispatch[_Global] = save_global_ref
    dispatch[_Tensor] = save_tensor
    dispatch[TensorValue] = save_tensor_value

    def __init__(self, file: Any, first_extra_key: int) -> None:
        super().__init__(file, protocol=2)
        self.first_extra_key = first_extra_key
        self.extra_storages: list[tuple[str, bytes]] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _Storage):
            return None
        if obj.dtype.storage_class:
            return ("storage", _Global("torch", obj.dtype.storage_class), obj.key, "cpu", obj.numel)
        return ("storage", _Global("torch.storage", "UntypedStorage"), obj.key, "cpu",
                obj.numel * obj.dtype.itemsize)


def pickle_state_dict(tensors: Sequence[TensorSpec], objects: Sequence[ObjectValue]) -> bytes:
    """The ``data.pkl`` of a torch.save archive holding ``tensors`` (storage keys 0..n-1) and
    ``objects``."""
    return _pickle_with_storages(tensors, objects)[0]


def _pickle_with_storages(tensors: Sequence[TensorSpec], objects: Sequence[ObjectValue]
                          ) -> tuple[bytes, list[tuple[str, bytes]]]:
    """``data.pkl``, and the storages of tensors inside ``objects`` (keys n, n+1...) with their
    bytes."""
    items: list[tuple[Any, Any]] = []
    for index, spec in enumerate(tensors):
        numel = spec.nbytes // spec.dtype.itemsize
        items.append((spec.key_path, _Tensor(_Storage(str(index), spec.dtype, numel), spec.shape)))
    items += [(o.key_path, o.value) for o in objects]
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, len(tensors))
    pickler.dump(unflatten(items))
    return buffer.getvalue(), pickler.extra_storages


class _Entry:
    def __init__(self, name: str, offset: int, size: int, data: bytes | None) -> None:
        self.name, self.offset, self.size, self.data = name.encode(), offset, size, data
        self.crc = crc32(data) if data is not None else 0
        self.zip64 = size >= _U32 or offset >= _U32

    def local_header(self, pad_to: int | None) -> bytes:
        extra = struct.pack("<HHQQ", 1, 16, self.size, self.size) if self.zip64 else b""
        size32 = _U32 if self.zip64 else self.size
        fixed = 30 + len(self.name) + len(extra)
        if pad_to is not None:  # an "FB" padding field, as torch writes, to align the data
            pad = -(self.offset + fixed + 4) % pad_to
            extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if self.zip64 else 20, 0x800, 0, 0,
                           0x21, self.crc, size32, size32, len(self.name), len(extra)) + \
            self.name + extra

    def central_header(self) -> bytes:
        extra = struct.pack("<HHQQQ", 1, 24, self.size, self.size, self.offset) \
            if self.zip64 else b""
        size32, off32 = (_U32, _U32) if self.zip64 else (self.size, self.offset)
        version = 45 if self.zip64 else 20
        return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0x800, 0, 0,
                           0x21, self.crc, size32, size32, len(self.name), len(extra), 0, 0,
                           0, 0, off32) + self.name + extra


def _end_records(entries: list[_Entry], cd_offset: int, cd_size: int) -> bytes:
    count = len(entries)
    out = b""
    if cd_offset >= _U32 or count >= 0xFFFF:
        eocd64 = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size,
                           cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                       min(cd_size, _U32), min(cd_offset, _U32), 0)
    return out


class TorchBinFormat(OutputFormat):
    name = "bin"
    suffix = "bin"
    model_file = "pytorch_model.bin"
    needs_crc = True

    def file_stem(self, kind: str) -> str:
        return "pytorch_model" if kind == "model" else kind  # HF's name for torch.save weights

    def layout(self, tensors: Sequence[TensorSpec], objects: Sequence[ObjectValue], *,
               nested: bool) -> FileLayout:
        data_pkl, extra_storages = _pickle_with_storages(tensors, objects)
        records: list[tuple[str, int, bytes | None]] = [
            ("data.pkl", 0, data_pkl),
            ("byteorder", 0, b"little"),
            *((f"data/{i}", spec.nbytes, None) for i, spec in enumerate(tensors)),
            *((f"data/{key}", 0, data) for key, data in extra_storages),
            ("version", 0, b"3\n"),
        ]
        entries, fixed, starts, offset = [], [], {}, 0
        for (name, size, data), spec_index in zip(records, range(-2, len(records))):
            size = len(data) if data is not None else size
            entry = _Entry(_PREFIX + name, offset, size, data)
            header = entry.local_header(_ALIGN if name.startswith("data/") else None)
            fixed.append((offset, header + (data or b"")))
            if data is None:
                starts[tensors[spec_index].name] = offset + len(header)
            offset += len(header) + size
            entries.append(entry)
        central = b"".join(e.central_header() for e in entries)
        end = _end_records(entries, offset, len(central))
        return FileLayout(tuple(fixed), starts, offset + len(central) + len(end),
                          trailer=(entries, offset))

    def finish(self, fd: int, layout: FileLayout, crcs: Mapping[str, int]) -> None:
        entries, cd_offset = layout.trailer
        names = {f"{_PREFIX}data/{i}".encode(): name for i, name in enumerate(layout.starts)}
        for entry in entries:
            if entry.name in names:
                entry.crc = crcs[names[entry.name]]
                pwrite_all(fd, struct.pack("<I", entry.crc), entry.offset + 14)
        central = b"".join(e.central_header() for e in entries)
        pwrite_all(fd, central + _end_records(entries, cd_offset, len(central)), cd_offset)
