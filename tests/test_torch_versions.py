""".metadata pickles shaped as older torch releases wrote them are read.

Each layout is built by hand, opcode by opcode, with the globals and field sets that
release's ``torch/distributed/checkpoint/metadata.py`` and ``filesystem.py`` pickle:

- torch 2.0-2.2: ``TensorProperties`` and its ``MEM_FORMAT_ENCODING`` from ShardedTensor's
  module; ``Metadata`` has three fields (no ``storage_meta``);
- torch 2.3-2.4: DCP's own ``TensorProperties`` and ``_MEM_FORMAT_ENCODING``;
  ``Metadata.storage_meta`` is a ``StorageMeta(checkpoint_id, save_id, load_id)`` whose
  ``checkpoint_id`` is a pickled ``pathlib`` path; ``_StorageInfo`` has three fields;
- later 2.x: ``StorageMeta.modules``, then ``Metadata.version`` ("1.0.0"), then
  ``_StorageInfo.transform_descriptors`` with a ``__getstate__`` that leaves out Nones
  (so torch 2.13 pickles the same three fields as 2.4 unless transforms are set).

A hand-built pickle of torch 2.13's layout is checked against a pickle torch itself
makes, so the builder is known to build what torch writes.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any

import pytest

from fsdpckpt import _torch
from fsdpckpt.dcp.reader import parse_metadata, read_dcp_folder

_BASE: Any = pickle._Pickler
_META = _torch.DCP_METADATA_MODULE
_SHARD = _torch.OLD_TENSOR_PROPERTIES[0]


class G:
    """A global, by name: pickled as GLOBAL without importing anything."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class New:
    """An instance as protocol 2+ pickles a dataclass: ``cls.__new__(cls)``, then BUILD."""

    def __init__(self, cls: G, state: Any = None) -> None:
        self.cls, self.state = cls, state


class Call:
    """``func(*args)`` (REDUCE): how torch.Size, enums and paths pickle."""

    def __init__(self, func: G, *args: Any) -> None:
        self.func, self.args = func, args


class _Pickler(_BASE):
    dispatch = dict(_BASE.dispatch)

    def _save_g(self, obj: G) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_new(self, obj: New) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[G] = _save_g
    dispatch[New] = _save_new
    dispatch[Call] = _save_call


def _dumps(value: Any, protocol: int) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=protocol).dump(value)
    return buffer.getvalue()


def _size(*dims: int) -> Call:
    return Call(G("torch", "Size"), tuple(dims))


def _metadata(layout: str) -> New:
    """One float32 tensor ``model.w`` [4, 2] in two chunks and one object ``model.step``."""
    old = layout == "2.0"
    properties_module = _SHARD if old else _META
    encoding = G(properties_module, "MEM_FORMAT_ENCODING" if old else "_MEM_FORMAT_ENCODING")
    properties = New(G(properties_module, "TensorProperties"),
                     (G("torch", "float32"), G("torch", "strided"), False,
                      Call(encoding, 0), False))

    def chunk(row: int) -> New:
        return New(G(_META, "ChunkStorageMetadata"),
                   {"offsets": _size(row, 0), "sizes": _size(2, 2)})

    tensor = New(G(_META, "TensorStorageMetadata"),
                 {"properties": properties, "size": _size(4, 2), "chunks": [chunk(0), chunk(2)]})

    def index(fqn: str, offsets: Call | None, i: int | None) -> New:
        return New(G(_META, "MetadataIndex"), {"fqn": fqn, "offset": offsets, "index": i})

    def info(file: str, offset: int, length: int) -> New:
        fields: dict[str, Any] = {"relative_path": file, "offset": offset, "length": length}
        if layout == "2.8-transforms":
            fields["transform_descriptors"] = []
        return New(G(*_torch.STORAGE_INFO), fields)

    storage = {index("model.w", _size(0, 0), 0): info("__0_0.distcp", 0, 1200),
               index("model.w", _size(2, 0), 1): info("__1_0.distcp", 0, 1200),
               index("model.step", None, None): info("__0_0.distcp", 1200, 300)}
    fields: dict[str, Any] = {
        "state_dict_metadata": {"model.w": tensor,
                                "model.step": New(G(_META, "BytesStorageMetadata"))},
        "planner_data": {"model.w": ("model", "w"), "model.step": ("model", "step")},
        "storage_data": storage,
    }
    if not old:
        meta: dict[str, Any] = {"checkpoint_id": Call(G("pathlib", "PosixPath"), "/", "ckpt"),
                                "save_id": "a1b2", "load_id": None}
        if layout != "2.4":
            meta["modules"] = []
        fields["storage_meta"] = New(G(_META, "StorageMeta"), meta)
    if layout in ("later-version", "2.8-transforms", "2.13"):
        fields["version"] = "1.0.0"
    return New(G(_META, "Metadata"), fields)


LAYOUTS = ["2.0", "2.4", "later-modules", "later-version", "2.8-transforms", "2.13"]


def _expected():
    return {"tensors": [("model.w", "float32", (4, 2), ("model", "w"),
                         [((0, 0), (2, 2), "__0_0.distcp", 0, 1200),
                          ((2, 0), (2, 2), "__1_0.distcp", 0, 1200)])],
            "objects": [("model.step", "__0_0.distcp", 1200, 300, ("model", "step"))]}


def _summary(meta) -> dict:
    return {"tensors": [(t.name, t.dtype.name, t.shape, t.key_path,
                         [(c.offsets, c.sizes, c.file, c.offset, c.length) for c in t.chunks])
                        for t in meta.tensors],
            "objects": [(o.name, o.file, o.offset, o.length, o.key_path) for o in meta.objects]}


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_metadata_shaped_as_an_older_torch_wrote_it_is_read(layout, protocol, tmp_path):
    (tmp_path / ".metadata").write_bytes(_dumps(_metadata(layout), protocol))
    meta = read_dcp_folder(tmp_path).metadata
    assert _summary(meta) == _expected()


def test_the_hand_built_layout_matches_what_torch_itself_pickles():
    # Guards the builder above: torch's own pickle of the same checkpoint reads the same.
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([2, 2])) for r in (0, 2)]
    real = _torch.dcp_metadata(
        {"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                          torch.Size([4, 2]), chunks),
         "model.step": BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "model.step": ("model", "step")},
        storage_data={MetadataIndex("model.w", [0, 0], 0): _StorageInfo("__0_0.distcp", 0, 1200),
                      MetadataIndex("model.w", [2, 0], 1): _StorageInfo("__1_0.distcp", 0, 1200),
                      MetadataIndex("model.step"): _StorageInfo("__0_0.distcp", 1200, 300)},
        storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="a1b2"), version="1.0.0")
    # The layout of the installed torch: 2.13's, or 2.6's (no version, no modules: 2.4's).
    has = {f.name for f in dataclasses.fields(Metadata)} | \
        {f.name for f in dataclasses.fields(StorageMeta)}
    layout = "2.13" if "version" in has else "later-modules" if "modules" in has else "2.4"
    from_torch = parse_metadata(pickle.dumps(real), source="torch")
    by_hand = parse_metadata(_dumps(_metadata(layout), 4), source="by hand")
    assert _summary(from_torch) == _summary(by_hand) == _expected()
