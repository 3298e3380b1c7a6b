"""Output formats for merged checkpoints, behind one small interface.

A format turns the list of tensors (names, dtypes, shapes) and the non-tensor
entries into a :class:`FileLayout`: the header bytes and where they go, where
each tensor's bytes start, and the file's size. The merge then places
every chunk's bytes at its final offset. A new format is a new module here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import KeyPath

__all__ = ["TensorSpec", "ObjectValue", "FileLayout", "OutputFormat", "get_format", "FORMATS"]


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
    """One way of writing a merged state dict to a file."""

    #: The ``--format`` name.
    name: str
    #: The file name Accelerate (or HF) gives a single-file output of a model.
    model_file: str
    #: Whether :meth:`finish` needs the CRC-32 of each tensor's bytes.
    needs_crc: bool = False

    @abstractmethod
    def layout(self, tensors: Sequence[TensorSpec], objects: Sequence[ObjectValue], *,
               nested: bool) -> FileLayout:
        """Place ``tensors`` in a file that also keeps ``objects``.

        ``nested`` says the key paths matter (optimizer state): the file must let a
        reader rebuild the nesting, not only the flat names.
        """

    def finish(self, fd: int, layout: FileLayout, crcs: Mapping[str, int]) -> None:  # noqa: B027
        """Write anything that depends on the data (checksums, a trailer). Default: nothing."""


def get_format(name: str) -> OutputFormat:
    """The format called ``name`` (``"safetensors"`` or ``"bin"``)."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of {sorted(FORMATS)}") from None


def _formats() -> dict[str, type[OutputFormat]]:
    from fsdpckpt.formats.safetensors import SafetensorsFormat
    from fsdpckpt.formats.torch_bin import TorchBinFormat

    return {"safetensors": SafetensorsFormat, "bin": TorchBinFormat}


FORMATS: dict[str, type[OutputFormat]] = {}
FORMATS.update(_formats())
