"""The interface every output format implements, and the plain types it speaks in.

Kept apart from the registry (``fsdpckpt/formats/__init__.py``) so that each format module
imports this one, and only the registry imports the formats.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import KeyPath

__all__ = ["TensorSpec", "ObjectValue", "FileLayout", "OutputFormat"]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the output file: its output name, nested key path, dtype and shape."""

    name: str
    key_path: KeyPath
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectValue:
    """A non-tensor entry of the output: its name, nested key path and Python value."""

    name: str
    key_path: KeyPath
    value: Any


@dataclass(frozen=True)
class FileLayout:
    """Where everything goes in one output file.

    Attributes:
        fixed: ``(offset, bytes)`` pieces known before any data (headers).
        starts: absolute byte offset of each tensor's data, by output name, in the
            order the tensors were given.
        size: the file's final size.
        trailer: format-specific data :meth:`OutputFormat.finish` needs.
    """

    fixed: tuple[tuple[int, bytes], ...]
    starts: Mapping[str, int]
    size: int
    trailer: Any = field(default=None, compare=False)


class OutputFormat(ABC):
    """One way of writing a merged state dict to a file.

    A format answers every question the merge has about it: its file names (from a
    stem such as ``model`` or ``optimizer``), which dtypes and names it can hold,
    and where each tensor's bytes go (:meth:`layout`). The planner and the writer
    never switch on a format's name.
    """

    #: The ``--format`` name.
    name: str
    #: The file name suffix, without the dot.
    suffix: str
    #: The file name Accelerate (or HF) gives a single-file output of a model.
    model_file: str
    #: Whether :meth:`finish` needs the CRC-32 of each tensor's bytes.
    needs_crc: bool = False

    def file_stem(self, kind: str) -> str:
        """The base of the file names for a merge of ``kind`` (``model``, ``optimizer``)."""
        return kind

    def single_file_name(self, stem: str) -> str:
        """The one file of an unsharded merge: ``model.safetensors``."""
        return f"{stem}.{self.suffix}"

    def shard_file_name(self, stem: str, number: int, count: int) -> str:
        """Shard ``number`` (from 1) of ``count``: ``model-00001-of-00003.safetensors``."""
        return f"{stem}-{number:05d}-of-{count:05d}.{self.suffix}"

    def index_file_name(self, stem: str) -> str:
        """The HF index of a sharded merge: ``model.safetensors.index.json``."""
        return f"{stem}.{self.suffix}.index.json"

    def is_shard_file_name(self, stem: str, name: str) -> bool:
        """Whether ``name`` is one of our shard names under ``stem`` (any number, any count)."""
        pattern = rf"{re.escape(stem)}-\d{{5,}}-of-\d{{5,}}\.{re.escape(self.suffix)}"
        return re.fullmatch(pattern, name) is not None

    def can_hold(self, dtype: DType) -> bool:
        """Whether a tensor of ``dtype`` can be written. Default: any."""
        return True

    def name_problem(self, stored: str, name: str) -> str | None:
        """Why the tensor ``stored`` cannot take the output ``name``, or None. Default: None."""
        return None

    @abstractmethod
    def layout(self, tensors: Sequence[TensorSpec], objects: Sequence[ObjectValue], *,
               nested: bool) -> FileLayout:
        """Place ``tensors`` in a file that also keeps ``objects``.

        ``nested`` says the key paths matter (optimizer state): the file must let a
        reader rebuild the nesting, not only the flat names.
        """

    def finish(self, fd: int, layout: FileLayout, crcs: Mapping[str, int]) -> None:  # noqa: B027
        """Write anything that depends on the data (checksums, a trailer). Default: nothing."""

    # Formats hold no state: two instances of one format are the same format.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"get_format({self.name!r})"
