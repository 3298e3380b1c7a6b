"""What ``dcp.load`` is given as the metadata of a checkpoint (issue 32, goal 3).

Where each chunk lies (torch's ``storage_data``) is made when the storage reader asks for
a chunk, not for every chunk of a large run on every rank: it must answer exactly what
torch's own reader of the same ``.metadata`` answers.
"""

from __future__ import annotations

import warnings

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

from fsdpckpt import _torch
from fsdpckpt.training._dcp_io import _torch_metadata

from conftest import FIXTURES

FOLDERS = [FIXTURES / "dtensor", FIXTURES / "fsdp2_accelerate" / "pytorch_model_fsdp_0",
           FIXTURES / "fsdp2_accelerate" / "optimizer_0",
           # Read for a load only by a torch whose DCP decodes compressed entries.
           pytest.param(FIXTURES / "dcp_zstd", marks=pytest.mark.skipif(
               not _torch.reads_transforms(), reason="this torch's DCP cannot decode zstd"))]


def _torchs(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FileSystemReader(str(folder)).read_metadata()  # a trusted fixture


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f"{f.parent.name}/{f.name}")
def test_every_chunk_lies_where_torchs_reader_says(folder):
    ours, _ = _torch_metadata(folder)
    theirs = _torchs(folder).storage_data
    assert len(ours.storage_data) == len(theirs)
    for index, info in theirs.items():
        assert ours.storage_data[index] == info, index
        assert index in ours.storage_data
    assert sorted(map(str, ours.storage_data)) == sorted(map(str, theirs))


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f"{f.parent.name}/{f.name}")
def test_the_planners_read_items_find_their_chunks(folder):
    ours, _ = _torch_metadata(folder)
    for name, entry in ours.state_dict_metadata.items():
        for i, chunk in enumerate(getattr(entry, "chunks", [])):
            hinted = MetadataIndex(name, chunk.offsets, i)
            assert ours.storage_data[hinted] == ours.storage_data[MetadataIndex(name,
                                                                                chunk.offsets)]


def test_an_index_the_metadata_does_not_hold_is_not_found():
    ours, archives = _torch_metadata(FOLDERS[0])
    name = next(iter(ours.state_dict_metadata))
    for index in (MetadataIndex("no.such.tensor", (0,)), MetadataIndex(name, (10**9, 0)),
                  MetadataIndex(name, (10**9, 0), 0), MetadataIndex("no.such.object")):
        assert index not in ours.storage_data
        with pytest.raises(KeyError):
            ours.storage_data[index]
        with pytest.raises(KeyError):
            archives[index]
