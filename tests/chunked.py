"""Writing DCP folders with chosen chunk layouts, as torch's FileSystemWriter lays them out.

Real runs give dim-0 shards (FSDP), dim-1 shards (tensor parallel), grids of both,
and chunks that ``torch.save`` kept with their strides (a transposed view). One
process cannot ask DCP for those layouts, so this writes the same files DCP
writes: each chunk a ``torch.save`` archive at an offset of ``__0_0.distcp``, and a
``.metadata`` of torch's own classes. torch's loader reads them back (the tests
compare against it).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

#: ``chunks(tensor)`` -> ``[(offsets, stored chunk tensor)]``
Layout = Callable[[torch.Tensor], list[tuple[tuple[int, ...], torch.Tensor]]]


def whole(tensor: torch.Tensor) -> list:
    return [((0,) * tensor.dim(), tensor)]


def split(dims: Sequence[int], parts: int = 2, *, transpose: bool = False) -> Layout:
    """Split on each of ``dims`` into ``parts`` (uneven where it does not divide).

    With ``transpose``, each 2-d chunk is stored as the transposed view of a
    contiguous transposed copy: same values, column-major storage.
    """

    def layout(tensor: torch.Tensor) -> list:
        pieces = [((0,) * tensor.dim(), tensor)]
        for dim in dims:
            step = -(-tensor.shape[dim] // parts)
            pieces = [(tuple(o if d != dim else o + start for d, o in enumerate(offsets)),
                       piece.narrow(dim, start, min(step, piece.shape[dim] - start)))
                      for offsets, piece in pieces
                      for start in range(0, piece.shape[dim], step)]
        out = []
        for offsets, piece in pieces:
            piece = piece.clone()
            if transpose:
                piece = piece.t().contiguous().t()
            out.append((offsets, piece))
        return out

    return layout


def write_dcp(path: Path, tensors: dict[str, tuple[torch.Tensor, Layout]], *,
              key: str = "model") -> Path:
    """Write ``{name: (tensor, layout)}`` as a DCP folder at ``path``, nested under ``key``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from fsdpckpt._torch import dcp_metadata

    path.mkdir(parents=True)
    entries, storage, planner = {}, {}, {}
    with open(path / "__0_0.distcp", "wb") as data:
        for name, (tensor, layout) in tensors.items():
            fqn = f"{key}.{name}"
            planner[fqn] = (key, name)
            chunks = []
            for index, (offsets, piece) in enumerate(layout(tensor)):
                start = data.tell()
                torch.save(piece, data)
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), piece.size()))
                storage[MetadataIndex(fqn, torch.Size(offsets), index)] = _StorageInfo(
                    "__0_0.distcp", start, data.tell() - start)
            entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype),
                                                 tensor.size(), chunks)
    with open(path / ".metadata", "wb") as meta:
        pickle.dump(dcp_metadata(entries, planner_data=planner, storage_data=storage,
                                 version="1.0.0"), meta)
    return path


def flip_stored_byte(folder: Path, tensor: int = 0, chunk: int = 0, *, where: float = 0.5,
                     mask: int = 0x01) -> Path:
    """Flip the bits ``mask`` of one byte of a stored chunk's data in the DCP folder
    ``folder``: chunk ``chunk`` of tensor ``tensor`` (in metadata order), the byte at
    fraction ``where`` of its storage (1.0: the last). Returns the data file changed."""
    from fsdpckpt.dcp._archive import locate_tensor
    from fsdpckpt.dcp.reader import read_dcp_folder

    entry = read_dcp_folder(folder).metadata.tensors[tensor].chunks[chunk]
    path = folder / entry.file
    with path.open("rb") as file:
        raw = locate_tensor(file, entry.offset, entry.length, source=str(path))
    data = bytearray(path.read_bytes())
    data[raw.storage_start + min(raw.storage_nbytes - 1, int(raw.storage_nbytes * where))] ^= mask
    path.write_bytes(bytes(data))
    return path


def place_stored(path: Path, raw, offsets: Sequence[int], shape: Sequence[int],
                 out: torch.dtype) -> bytearray:
    """What the copy engine makes of the chunk ``raw`` stored in the file ``path``, placed at
    ``offsets`` of a zero tensor of ``shape`` cast to ``out``: that tensor's bytes."""
    import math
    import os

    from fsdpckpt.dcp.dtypes import DTYPES
    from fsdpckpt.dcp.metadata import Chunk
    from fsdpckpt.merging._copy import MemorySink, place_chunk
    from fsdpckpt.merging._runs import chunk_runs

    memory = bytearray(math.prod(shape) * torch.empty((), dtype=out).element_size())
    chunk = Chunk(tuple(offsets), tuple(raw.shape), "f", 0, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        place_chunk(fd, raw, chunk, chunk_runs(tuple(shape), chunk), DTYPES[str(out)[6:]],
                    MemorySink(memoryview(memory)), 0, source="test")
    finally:
        os.close(fd)
    return memory

