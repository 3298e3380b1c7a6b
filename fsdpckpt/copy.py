"""Moving one chunk's bytes to their place in an output file.

The fast path never decodes a tensor: a chunk that is one contiguous run of
its output tensor (FSDP's dim-0 shards) is copied file to file with
``os.copy_file_range``; a chunk that is many runs (dim-1 shards) is read once
and written run by run. Only a dtype conversion or a non-contiguous stored
chunk imports torch, and then holds one chunk in memory.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from .archive import RawTensor
from .dtypes import DType
from .errors import CorruptCheckpointError
from .metadata import Chunk

__all__ = ["copy_range", "read_exact", "place_chunk", "convert", "stored_tensor"]

_BLOCK = 16 * 2**20
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF,
                       errno.EPERM}
_copy_file_range_works = hasattr(os, "copy_file_range")


def read_exact(fd: int, count: int, offset: int, *, source: str) -> bytes:
    """``count`` bytes at ``offset`` of ``fd``, or a CorruptCheckpointError naming ``source``."""
    data = os.pread(fd, count, offset)
    while len(data) < count:
        more = os.pread(fd, count - len(data), offset + len(data))
        if not more:
            raise CorruptCheckpointError(f"{source}: the file ends before byte "
                                         f"{offset + count}: it is truncated")
        data += more
    return data


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, count: int, *,
               source: str, progress: Callable[[int], None] | None = None) -> None:
    """Copy ``count`` bytes between files: in the kernel where it can, else in 16 MiB blocks."""
    global _copy_file_range_works
    while count > 0 and _copy_file_range_works:
        try:
            done = os.copy_file_range(src, dst, min(count, 2**30), src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in _NO_COPY_FILE_RANGE:
                raise
            _copy_file_range_works = False
            break
        if done == 0:
            raise CorruptCheckpointError(f"{source}: the file ends before byte "
                                         f"{src_offset + count}: it is truncated")
        src_offset, dst_offset, count = src_offset + done, dst_offset + done, count - done
        if progress:
            progress(done)
    while count > 0:
        block = read_exact(src, min(count, _BLOCK), src_offset, source=source)
        os.pwrite(dst, block, dst_offset)
        src_offset, dst_offset, count = src_offset + len(block), dst_offset + len(block), \
            count - len(block)
        if progress:
            progress(len(block))


def stored_tensor(storage: bytearray, raw: RawTensor) -> Any:
    """The chunk as a torch tensor viewing ``storage`` (the bytes of its whole storage)."""
    import torch

    flat = torch.frombuffer(storage, dtype=getattr(torch, raw.dtype.name))
    return torch.as_strided(flat, raw.shape, raw.stride, raw.storage_offset)


def convert(data: bytes | bytearray, raw: RawTensor, out: DType) -> bytes:
    """Reorder a stored chunk to row-major and convert it to ``out``, with torch."""
    import torch

    if raw.nbytes == 0:
        return b""
    storage = data if isinstance(data, bytearray) else bytearray(data)
    tensor = stored_tensor(storage, raw).to(getattr(torch, out.name)).contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def place_chunk(src: int, raw: RawTensor, chunk: Chunk, runs: tuple[int, list[int]],
                out: DType, dst: int, tensor_start: int, *, source: str,
                progress: Callable[[int], None] | None = None) -> None:
    """Write one chunk's elements at their place in the output tensor.

    Args:
        src: the open data file holding the chunk.
        raw: where the chunk's storage is, and its dtype, shape and strides.
        chunk: the chunk, as the metadata places it.
        runs: :func:`fsdpckpt.plan.chunk_runs` of the chunk in its tensor.
        out: the output dtype.
        dst: the open output file.
        tensor_start: byte offset of the output tensor's first element.
        source: how to name the chunk in messages.
        progress: called with the number of bytes written, as they are.
    """
    run, starts = runs
    if not starts:
        return
    if raw.shape != chunk.sizes:
        raise CorruptCheckpointError(f"{source}: holds shape {list(raw.shape)}, the metadata "
                                     f"says {list(chunk.sizes)}")
    same = raw.dtype.name == out.name
    if same and raw.is_contiguous and len(starts) == 1:
        copy_range(src, raw.data_start, dst, tensor_start + starts[0] * out.itemsize, raw.nbytes,
                   source=source, progress=progress)
        return
    if same and raw.is_contiguous:
        data: bytes = read_exact(src, raw.nbytes, raw.data_start, source=source)
    else:
        storage = read_exact(src, raw.storage_nbytes, raw.storage_start, source=source)
        data = convert(storage, raw, out)
    view, width = memoryview(data), run * out.itemsize
    for i, start in enumerate(starts):
        os.pwrite(dst, view[i * width:(i + 1) * width], tensor_start + start * out.itemsize)
    if progress:
        progress(len(data))
