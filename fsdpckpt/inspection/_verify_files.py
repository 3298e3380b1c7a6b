"""``verify`` of what ``inspect`` and ``diff`` read besides checkpoints: the output folder of
``export-hf`` or ``merge`` (a Hugging Face model folder), a shard index, a weight file.

Each weight file is read by the reader ``load_pretrained`` checks a model folder with
(:func:`fsdpckpt.training._pretrained_source.read_weights`): a safetensors header strictly
(the one parser, :func:`~fsdpckpt.dcp._hfstorage.parse_header`, and, as safetensors' own
loader asks, its tensors filling the data section exactly to the end of the file), a ``.bin``
through fsdpckpt's restricted unpickler, never ``torch.load``. A shard index is checked
against its shards: every file it names is there, every tensor it lists is in the file it
names, every tensor of a shard is listed, and no tensor is in two files.

Then every tensor's bytes are read, in bounded blocks. A ``.bin`` storage entry is checked
against the CRC-32 its zip directory records, and a mismatch names the tensor. A safetensors
file records no checksum: its bytes are read all the same (a cut-short or unreadable file
fails), but a changed byte cannot be seen, so such files are listed as unchecked. Neither
``merge`` nor ``export-hf`` writes a manifest of its output, so there is nothing more to
check against; ``diff`` against the source checkpoint checks the values.
"""

from __future__ import annotations

from collections.abc import Iterable

from fsdpckpt._io.checksums import crc32_range
from fsdpckpt._io.storage import Place
from fsdpckpt._progress import ProgressFactory, start_progress
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp.checks import Problem
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.formats._shards import read_shard_index
from fsdpckpt.training._pretrained_source import OpenFiles, Stored, read_weights

__all__ = ["verify_model_files"]

_SHOWN = 5  # names listed in full for one kind of problem of one file; the rest are counted

Weights = dict[str, Stored]


def _problem(file: Place, exc: FsdpCkptError, what: str = "") -> Problem:
    """``exc`` as a problem of ``file``, its message without the file's name in front (the
    problem names it), prefixed by ``what`` (the tensor) when given."""
    message = str(exc)
    if message.startswith(f"{file}: "):
        message = message[len(f"{file}: "):]
    return Problem(str(file), f"{what}: {message}" if what else message)


def _read(file: Place, problems: list[Problem]) -> Weights | None:
    try:
        return read_weights(file)
    except FsdpCkptError as exc:
        problems.append(_problem(file, exc))
        return None


def _named(problems: list[Problem], file: Place, names: list[str], says: str) -> None:
    """One problem per name (``says`` formatted with ``name``), the first few; then a count."""
    problems += [Problem(str(file), says.format(name=name)) for name in names[:_SHOWN]]
    if len(names) > _SHOWN:
        problems.append(Problem(str(file), f"and {len(names) - _SHOWN} more tensors alike"))


def _shards(index: Place, problems: list[Problem]) -> list[tuple[Place, Weights]]:
    """The shards of ``index``, each read, and the index checked against them."""
    try:
        shard_index = read_shard_index(index)
    except FsdpCkptError as exc:
        problems.append(_problem(index, exc))
        return []
    found: list[tuple[Place, Weights]] = []
    for file in shard_index.files:
        if not file.is_file():
            problems.append(Problem(str(file), f"listed in {index.name} but missing; copy "
                                    "every shard beside the index"))
        elif (weights := _read(file, problems)) is not None:
            found.append((file, weights))
    weight_map = shard_index.weight_map
    held: dict[str, Place] = {}
    for file, weights in found:
        twice = [n for n in weights if n in held]
        for name in twice:
            problems.append(Problem(str(file), f"holds tensor '{name}', which "
                                    f"{held[name].name} holds too: the folder mixes two saves"))
        held.update({n: file for n in weights if n not in held})
        _named(problems, file, [n for n in weights if n not in weight_map],
               f"holds tensor '{{name}}', which {index.name} does not list: a loader "
               "following the index never reads it")
        lacking = [n for n, f in weight_map.items() if index.parent / f == file
                   and n not in weights]
        _named(problems, file, lacking, f"{index.name} lists tensor '{{name}}' in this file, "
               "which lacks it: the shards come from another save; copy them again")
    return found


def _entries(weights: Iterable[tuple[Place, Weights]]
             ) -> list[tuple[Place, RawTensor, list[str]]]:
    """Each stored data range once, with every tensor name it holds (in a ``.bin``, tied
    weights share one storage entry)."""
    entries: dict[tuple[str, int], tuple[Place, RawTensor, list[str]]] = {}
    for file, tensors in weights:
        for name, stored in tensors.items():
            key = (str(file), stored.raw.storage_start)
            entries.setdefault(key, (file, stored.raw, []))[2].append(name)
    return list(entries.values())


def _tensor(names: list[str]) -> str:
    shared = f" (and {', '.join(repr(n) for n in names[1:])}, sharing its storage)" \
        if len(names) > 1 else ""
    return f"tensor '{names[0]}'{shared}"


def verify_model_files(files: list[Place], progress: ProgressFactory | None = None
                       ) -> tuple[list[Problem], tuple[str, ...]]:
    """Check the model files ``files`` as the module docstring says.

    Args:
        files: weight files and shard indexes (an output folder's model and optimizer, as
            :func:`~fsdpckpt.inspection._inspect_files.model_files_in` finds them).
        progress: a progress factory, called once with the bytes of tensor data to read
            and the number of weight files, before any is read.

    Returns:
        The problems found, and the files whose format records no checksum (safetensors):
        their structure was checked and every byte read, but a changed byte cannot be seen.

    Example:
        >>> problems, unchecked = verify_model_files([Path("out/model.safetensors")])
        >>> problems, unchecked
        ([], ('out/model.safetensors',))
    """
    problems: list[Problem] = []
    weights: list[tuple[Place, Weights]] = []
    for file in files:
        if file.name.endswith(".index.json"):
            weights += _shards(file, problems)
        elif (read := _read(file, problems)) is not None:
            weights.append((file, read))
    entries = _entries(weights)
    callback = start_progress(progress, sum(raw.storage_nbytes for _, raw, _ in entries),
                              len(weights))
    with OpenFiles() as opened:
        for file, raw, names in entries:
            try:
                # Read whole, in blocks: a file cut short or unreadable fails here.
                crc = crc32_range(opened.src(file), raw.storage_start, raw.storage_nbytes,
                                  callback, source=str(file))
            except FsdpCkptError as exc:
                problems.append(_problem(file, exc, _tensor(names)))
                continue
            if raw.crc32 is not None and crc != raw.crc32:
                problems.append(Problem(str(file), f"{_tensor(names)} (zip entry "
                                        f"'{raw.entry}'): data does not match the CRC-32 its "
                                        f"writer recorded (recorded {raw.crc32:08x}, read "
                                        f"{crc:08x}): a changed byte; restore the file from "
                                        "a good copy"))
    unchecked = tuple(str(file) for file, tensors in weights
                      if any(s.raw.crc32 is None for s in tensors.values()))
    return problems, unchecked
