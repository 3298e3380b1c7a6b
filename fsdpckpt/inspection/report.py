"""The typed results of ``inspect`` and ``verify``, and the JSON documents ``--json`` prints.

Each report is a frozen dataclass whose attributes are named as the keys of its JSON
document, in the same order; ``to_json()`` gives that document (plain dicts, lists, strings,
numbers, booleans and None), which ``fsdpckpt inspect --json`` and ``fsdpckpt verify --json``
print with ``json.dumps(doc, indent=2)``. A report also answers ``report["ok"]``, as the dicts
these functions returned before, by looking the key up in ``to_json()``; attributes
(``report.ok``) are the way forward: typed, and without building the whole document.

Where the read side has a type already (:class:`~fsdpckpt.dcp.metadata.Chunk`,
:class:`~fsdpckpt.dcp.metadata.ObjectEntry`, :class:`~fsdpckpt.dcp.metadata.DataFile`,
:class:`~fsdpckpt.dcp.layout.SideFile`, :class:`~fsdpckpt.dcp.checks.Problem`), a report holds
it as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpckpt._io.remote import RemotePath
from fsdpckpt._printable import human_bytes, printable
from fsdpckpt.dcp.checks import Problem
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.layout import SideFile, natural_key
from fsdpckpt.dcp.metadata import Chunk, DataFile, ObjectEntry

__all__ = ["AdapterReport", "InspectReport", "PartReport", "TensorReport", "VerifyReport"]


class _JsonDocument:
    """Lets a report be read like the dict it replaces: ``report["problems"]``."""

    #: Not a sequence: without this, ``__getitem__`` would make ``iter(report)`` "work".
    __iter__ = None

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        """The value ``to_json()`` has under ``key`` (KeyError if none); prefer attributes."""
        return self.to_json()[key]


def _chunk_json(chunk: Chunk) -> dict[str, Any]:
    return {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": chunk.file,
            "offset": chunk.offset, "length": chunk.length}


def _object_json(obj: ObjectEntry) -> dict[str, Any]:
    return {"name": obj.name, "file": obj.file, "offset": obj.offset, "length": obj.length,
            "key_path": list(obj.key_path)}


@dataclass(frozen=True)
class TensorReport(_JsonDocument):
    """One tensor of a DCP folder, as ``inspect`` lists it.

    Attributes:
        name: the tensor's flattened name (``"model.layers.0.weight"``).
        dtype: its element type.
        shape: its full (unsharded) shape.
        bytes: its size unsharded.
        sharding: how it is split, in words (``"dim0 x2"``, ``"replicated"``; see
            :func:`fsdpckpt.inspection.inspect.sharding_of`).
        chunks: its chunks as the metadata lists them.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    bytes: int
    sharding: str
    chunks: tuple[Chunk, ...]

    def cells(self) -> list[str | int]:
        """Its row of inspect's tables (name, dtype, shape, chunks, sharding, bytes): the
        text output's and the ``--html`` page's, checkpoint strings made printable."""
        count: str | int = "-" if self.sharding == "whole" else len(self.chunks)  # a file's
        return [printable(self.name), printable(self.dtype.name),
                "[" + ", ".join(map(str, self.shape)) + "]", count, self.sharding,
                human_bytes(self.bytes)]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape),
                "bytes": self.bytes, "sharding": self.sharding,
                "chunks": [_chunk_json(c) for c in self.chunks]}


def _in_name_order(tensors: Iterable[TensorReport]) -> tuple[TensorReport, ...]:
    """``tensors`` by name, numbers by value (``state.2`` before ``state.10``)."""
    def key(tensor: TensorReport) -> tuple[list[tuple[int, int | str]], str]:
        return natural_key(tensor.name), tensor.name  # "x.01" and "x.1" tie: the name decides
    return tuple(sorted(tensors, key=key))


@dataclass(frozen=True)
class PartReport(_JsonDocument):
    """One DCP folder of a checkpoint (``pytorch_model_fsdp_0/``, ``optimizer_0/``, or the
    folder itself).

    A part without ``.metadata`` (``complete`` False: its save never finished) has only
    ``name`` to ``complete``; the other attributes are zero or empty and its JSON document
    leaves them out.

    Attributes:
        name, kind, index, path, complete: as :class:`~fsdpckpt.dcp.layout.DcpPart` has them.
        version: the metadata's DCP version string, if it records one.
        world_size: the world size its rank files show; see ``world_size_exact``.
        world_size_exact: False when ``world_size`` is only a lower bound
            (:func:`~fsdpckpt.dcp.checks.known_world_size`).
        bytes: the size of its data files.
        tensor_bytes: the size of its tensors, unsharded.
        num_tensors, num_objects: how many tensors and non-tensor entries it holds (all of
            them, whatever ``names`` kept).
        dtypes: how many tensors of each dtype, most frequent first.
        files: its data files.
        tensors, objects: the tensors and non-tensor entries whose name matched ``names``;
            the tensors by name (numbers by value), the objects as stored.
        rank_local: for a per-rank optimizer part whose every rank stores its own state
            whole (FSDP1's ``optimizer.state_dict()``, as VeRL saves it), why nothing can
            merge it; its tensors are then not listed. Empty otherwise.
    """

    name: str
    kind: str
    index: int | None
    path: Path | RemotePath
    complete: bool
    version: str | None = None
    world_size: int = 0
    world_size_exact: bool = True
    bytes: int = 0
    tensor_bytes: int = 0
    num_tensors: int = 0
    num_objects: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    files: tuple[DataFile, ...] = ()
    tensors: tuple[TensorReport, ...] = ()
    objects: tuple[ObjectEntry, ...] = ()
    rank_local: str = ""

    def listed(self) -> tuple[TensorReport, ...]:
        """The tensors in the order inspect's tables show them (text and ``--html``): by
        name, numbers by value (``layers.2`` before ``layers.10``).

        Not storage order, which ``tensors`` and ``--json`` keep: DCP's ``.metadata`` lists
        tensors as the ranks' save plans held them, and a tensor replicated across ranks (an
        optimizer's ``step``) is planned on whichever rank balances the files, which
        scatters a parameter's state over the table; a safetensors file orders its header
        by dtype and text (``layers.10`` before ``layers.2``). By name, each parameter's
        state is together (``state.0.bias.exp_avg``, ``.exp_avg_sq``, ``.step``), and
        layers come in their order.
        """
        return _in_name_order(self.tensors)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "kind": self.kind, "index": self.index,
                               "path": str(self.path), "complete": self.complete}
        if not self.complete:
            return doc
        doc.update({
            "version": self.version,
            "world_size": self.world_size,
            "world_size_exact": self.world_size_exact,
            "bytes": self.bytes,
            "tensor_bytes": self.tensor_bytes,
            "num_tensors": self.num_tensors,
            "num_objects": self.num_objects,
            "dtypes": dict(self.dtypes),
            "files": [{"name": f.name, "size": f.size, "rank": f.rank} for f in self.files],
            "tensors": [t.to_json() for t in self.tensors],
            "objects": [_object_json(o) for o in self.objects],
        })
        if self.rank_local:
            doc["rank_local"] = self.rank_local
        return doc


@dataclass(frozen=True)
class AdapterReport(_JsonDocument):
    """A PEFT LoRA ``adapter_config.json`` in the checkpoint folder, as the export reads it.

    Attributes:
        file: its name. r: the rank. lora_alpha: alpha. target_modules: the module names
        (or regex) adapted. use_rslora, use_dora: the variants that change the fused weights.
    """

    file: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    use_rslora: bool
    use_dora: bool

    def to_json(self) -> dict[str, Any]:
        targets = self.target_modules
        return {"file": self.file, "r": self.r, "lora_alpha": self.lora_alpha,
                "target_modules": list(targets) if isinstance(targets, tuple) else targets,
                "use_rslora": self.use_rslora, "use_dora": self.use_dora}


@dataclass(frozen=True)
class InspectReport(_JsonDocument):
    """What :func:`fsdpckpt.inspect_checkpoint` found: the checkpoint's parts and whether its
    structure is whole.

    Attributes:
        path: the checkpoint folder.
        style: ``"dcp"`` (a bare DCP folder), ``"accelerate"``, ``"hf-trainer"``, ``"verl"``,
            ``"hf-storage"`` (torch's ``HuggingFaceStorageWriter``), ``"lightning"``,
            ``"torchtune"`` or ``"torchtitan"`` (a trainer's one DCP folder).
        ok: (a property) True when ``problems`` is empty.
        world_size: the world size that wrote it, from its rank files.
        world_size_exact: False when ``world_size`` is only a lower bound.
        bytes: the size of every recognized file (data files and side files).
        parts: its DCP folders.
        side_files: the other state it holds (RNG, scheduler, custom checkpoints...).
        other_files: names of files that are neither.
        problems: everything found wrong with its structure, in a stable order.
        adapter: the LoRA adapter config in the folder (``adapter_config.json``), or None;
            in the JSON document only when there is one.
    """

    path: Path | RemotePath
    style: str
    world_size: int
    world_size_exact: bool
    bytes: int
    parts: tuple[PartReport, ...]
    side_files: tuple[SideFile, ...]
    other_files: tuple[str, ...]
    problems: tuple[Problem, ...]
    adapter: AdapterReport | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unfinished(self) -> bool:
        """Whether a save into it did not finish: a DCP folder without its ``.metadata``
        (written last), as a save cut short leaves it."""
        return any(not p.complete for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        """The document ``fsdpckpt inspect --json`` prints (schema in ``docs/cli.md``)."""
        doc = {
            "path": str(self.path),
            "style": self.style,
            "ok": self.ok,
            "unfinished": self.unfinished,
            "world_size": self.world_size,
            "world_size_exact": self.world_size_exact,
            "bytes": self.bytes,
            "parts": [p.to_json() for p in self.parts],
            "side_files": [{"name": f.name, "kind": f.kind, "rank": f.rank, "size": f.size}
                           for f in self.side_files],
            "other_files": list(self.other_files),
            "problems": [p.to_json() for p in self.problems],
        }
        if self.adapter is not None:
            doc["adapter"] = self.adapter.to_json()
        return doc


@dataclass(frozen=True)
class VerifyReport(_JsonDocument):
    """What :func:`fsdpckpt.verify_checkpoint` found: whether every byte is what was written.

    Attributes:
        path: the checkpoint, as given.
        ok: (a property) True when ``problems`` is empty.
        manifest: whether it was checked against a manifest (``fsdpckpt.json``); without
            one, each chunk was checked against its archive's own CRC-32.
        manifest_digest: the manifest's own digest (``"sha256:<hex>"``), or None without one.
        digest: the per-file digest the manifest carries (``"sha256"``, ``"blake2b"``), or
            None when it carries CRC-32 only.
        problems: everything found wrong, each once.
        unchecked: the data files whose format records no checksum (safetensors files of
            torch's Hugging Face storage, of an export or a merge) and that no manifest
            covers: their structure was checked, but a changed byte in their tensor data
            cannot be seen.
        style: what was verified, named as :attr:`InspectReport.style` names it (a
            checkpoint's layout, or ``"model-file"`` / ``"model-folder"`` for an export's
            or a merge's output and its files).
        unfinished: a save into it did not finish (a DCP folder without ``.metadata``): not
            damage to repair, a checkpoint that never was.
    """

    path: Path | RemotePath
    manifest: bool
    manifest_digest: str | None
    digest: str | None
    problems: tuple[Problem, ...]
    unchecked: tuple[str, ...] = ()
    style: str = ""
    unfinished: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The document ``fsdpckpt verify --json`` prints (schema in ``docs/cli.md``)."""
        return {"path": str(self.path), "ok": self.ok, "manifest": self.manifest,
                "manifest_digest": self.manifest_digest, "digest": self.digest,
                "problems": [p.to_json() for p in self.problems],
                "unchecked": list(self.unchecked), "style": self.style,
                "unfinished": self.unfinished}
