"""Whether a tied target holds the same bytes as the tensor it is tied to, read box by box.

The config says ``lm_head.weight`` is tied to ``model.embed_tokens.weight``, so the export
writes only the embeddings. That is right only when the checkpoint's two tensors are equal:
a run that untied them (or trained with ``tie_word_embeddings`` wrong in its config) holds
two different matrices, and dropping one would silently change the model. Both are read
from the checkpoint in the same boxes (a contiguous run of row-major elements, at most
:data:`BOX_BYTES` each), so memory holds two boxes, never a whole tensor.
"""

from __future__ import annotations

from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.merging._copy import MemorySink, locate_stored_chunk, place_chunk
from fsdpckpt.merging._runs import boxes, chunk_runs

__all__ = ["BOX_BYTES", "same_bytes", "read_box"]

#: The most bytes of each tensor held at once.
BOX_BYTES = 8 * 2**20


def same_bytes(files: DataFiles, a: TensorEntry, b: TensorEntry, *,
               box_bytes: int = BOX_BYTES) -> bool:
    """Whether stored tensors ``a`` and ``b`` of one folder are equal, byte for byte.

    A different dtype or shape is not equal. Reads both in the same boxes and stops at the
    first that differs.

    Raises:
        CorruptCheckpointError, NotACheckpointError: a chunk's data is damaged or missing.
    """
    if a.dtype.name != b.dtype.name or tuple(a.shape) != tuple(b.shape):
        return False
    itemsize = a.dtype.itemsize
    for offsets, sizes in boxes(a.shape, max(1, box_bytes // itemsize)):
        count = 1
        for s in sizes:
            count *= s
        left, right = bytearray(count * itemsize), bytearray(count * itemsize)
        read_box(files, a, offsets, sizes, memoryview(left))
        read_box(files, b, offsets, sizes, memoryview(right))
        if left != right:
            return False
    return True


def read_box(files: DataFiles, tensor: TensorEntry, offsets: tuple[int, ...],
             sizes: tuple[int, ...], out: memoryview) -> None:
    """Read the box ``offsets``/``sizes`` of the stored ``tensor`` into ``out`` (row-major,
    in the stored dtype), reading only the parts of its chunks inside the box.

    Raises:
        CorruptCheckpointError, NotACheckpointError, ChecksumError: a chunk's data is
            damaged or missing.
    """
    # Each stored chunk's part inside the box is itself a strided view of the chunk's
    # storage: placed as a chunk of the box, so only that part is read.
    sink = MemorySink(out)
    for chunk in tensor.chunks:
        low = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
        high = [min(o + s, c + k) for o, s, c, k in
                zip(offsets, sizes, chunk.offsets, chunk.sizes)]
        if any(h <= lo for lo, h in zip(low, high)):
            continue
        raw, src, source = locate_stored_chunk(files, tensor, chunk, check_shape=True)
        part = tuple(h - lo for lo, h in zip(low, high))
        skip = sum((lo - c) * st for lo, c, st in zip(low, chunk.offsets, raw.stride))
        sub_raw = RawTensor(raw.storage_start, raw.storage_nbytes, raw.dtype,
                            raw.storage_offset + skip, part, raw.stride)
        sub = Chunk(tuple(lo - o for lo, o in zip(low, offsets)), part, chunk.file, 0, 0)
        place_chunk(src, sub_raw, sub, chunk_runs(sizes, sub), tensor.dtype, sink, 0,
                    source=source)
