"""Whether a tied target holds the same bytes as the tensor it is tied to, read box by box.

The config says ``lm_head.weight`` is tied to ``model.embed_tokens.weight``, so the export
writes only the embeddings. That is right only when the checkpoint's two tensors are equal:
a run that untied them (or trained with ``tie_word_embeddings`` wrong in its config) holds
two different matrices, and dropping one would silently change the model. Both are read
from the checkpoint in the same boxes (a contiguous run of row-major elements, at most
:data:`BOX_BYTES` each), so memory holds two boxes, never a whole tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.errors import ExportMismatchError
from fsdpckpt.merging._copy import MemorySink, locate_stored_chunk, place_chunk
from fsdpckpt.merging._runs import boxes, chunk_runs

if TYPE_CHECKING:  # the merger's job, only named here
    from fsdpckpt.merging.merger import MergeJob

__all__ = ["BOX_BYTES", "compare_tied", "same_bytes", "read_box", "refuse_differing"]

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


def refuse_differing(checkpoint: Place, tied: dict[str, str],
                     compared: dict[tuple[str, str], bool], config: Place,
                     untie: bool) -> None:
    """Refuse an export whose config ties tensors the checkpoint holds with different bytes.

    The config decides what is tied; the bytes must agree, or dropping the target would
    silently change the model.

    Args:
        checkpoint: the checkpoint's folder, for messages.
        tied: tied target -> the tensor it is tied to.
        compared: ``(target, source)`` -> whether :func:`same_bytes` found them equal
            (pairs not compared count as equal).
        config: the config that ties them, for messages.
        untie: whether the user asked for both to be written (the class may tie them still).

    Raises:
        ExportMismatchError: a pair differs; the message says what to pass.
    """
    for target, source in sorted(tied.items()):
        if compared.get((target, source), True):
            continue
        if untie:  # still tied: the class ties them whatever the config says (T5 in 5.x)
            raise ExportMismatchError(
                f"{checkpoint}: {target} and {source} differ, and the model class {config} "
                f"describes ties them even with tie_word_embeddings: false (as transformers "
                f"5's T5 does): it would load {source} as {target}, so no export as that "
                f"class keeps both; load the run with the transformers version it was "
                f"trained with")
        raise ExportMismatchError(
            f"{checkpoint}: {target} and {source} differ, but {config} ties them "
            f"(tie_word_embeddings), so {target} would not be written and the model would "
            f"change; pass --untie (untie=True) to write both and set tie_word_embeddings: "
            f"false, or pass base=... with the config this run trained")


def compare_tied(job: MergeJob, pairs: dict[str, str]) -> dict[tuple[str, str], bool]:
    """Whether each ``(target, source)`` pair of ``pairs`` that the job's checkpoint holds
    has the same bytes under both names, read box by box (:func:`same_bytes`); pairs with a
    name the checkpoint lacks are left out. Run before any weight is written."""
    found: dict[tuple[str, str], bool] = {}
    for plan in job.plans:
        entries = {t.spec.name: t.source for f in plan.files for t in f.tensors}
        wanted = [(t, s) for t, s in sorted(pairs.items()) if t in entries and s in entries]
        if not wanted:
            continue
        files = DataFiles(plan.folder.path)
        try:
            for target, source in wanted:
                found[(target, source)] = same_bytes(files, entries[target], entries[source])
        finally:
            files.close()
    return found
