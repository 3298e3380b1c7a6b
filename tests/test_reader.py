"""The safe reader agrees with torch's own FileSystemReader on every fixture."""

from __future__ import annotations

import json
import pickle

import pytest
from click.testing import CliRunner
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from fsdpckpt.cli import main
from fsdpckpt.reader import parse_metadata, read_dcp_folder


def _torch_view(folder):
    """Tensors and objects as torch's reader sees them, in the inspect --json vocabulary."""
    md = FileSystemReader(str(folder)).read_metadata()
    tensors, objects = {}, {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            info = md.storage_data[MetadataIndex(fqn)]
            objects[fqn] = {"file": info.relative_path, "offset": info.offset,
                            "length": info.length, "key_path": list(md.planner_data[fqn])}
            continue
        chunks = []
        for chunk in entry.chunks:
            info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                           "file": info.relative_path, "offset": info.offset,
                           "length": info.length})
        tensors[fqn] = {"dtype": str(entry.properties.dtype).removeprefix("torch."),
                        "shape": list(entry.size), "chunks": chunks}
    return tensors, objects


def _inspect_json(path):
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_inspect_json_matches_torch_tensor_by_tensor_and_chunk_by_chunk(dcp_folder):
    tensors, objects = _torch_view(dcp_folder)
    (part,) = _inspect_json(dcp_folder)["parts"]
    ours = {t["name"]: {k: t[k] for k in ("dtype", "shape", "chunks")} for t in part["tensors"]}
    assert ours == tensors
    assert {o["name"]: {k: o[k] for k in ("file", "offset", "length", "key_path")}
            for o in part["objects"]} == objects


def test_inspect_json_keeps_the_metadata_order_of_tensors(dcp_folder):
    md = FileSystemReader(str(dcp_folder)).read_metadata()
    expected = [k for k, v in md.state_dict_metadata.items()
                if not isinstance(v, BytesStorageMetadata)]
    (part,) = _inspect_json(dcp_folder)["parts"]
    assert [t["name"] for t in part["tensors"]] == expected


def test_key_paths_come_from_planner_data(dcp_folder):
    md = FileSystemReader(str(dcp_folder)).read_metadata()
    ours = read_dcp_folder(dcp_folder).metadata
    for entry in ours.tensors + ours.objects:
        assert entry.key_path == tuple(md.planner_data[entry.name])


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_reads_metadata_pickled_with_any_protocol(dcp_folder, protocol):
    # Torch has used protocol 2 (torch.save's default) and pickle's default over the
    # versions we support; the allowlist must not depend on the opcodes chosen.
    md = FileSystemReader(str(dcp_folder)).read_metadata()
    md.storage_meta = None  # torch adds a load_id here on read; older files have none
    ours = parse_metadata(pickle.dumps(md, protocol=protocol), source="x")
    assert ours == read_dcp_folder(dcp_folder).metadata


def test_reader_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    from conftest import DCP_FOLDERS

    code = ("import sys, fsdpckpt.cli, fsdpckpt.reader as r;"
            f"r.read_dcp_folder({str(DCP_FOLDERS['dtensor'])!r});"
            "from click.testing import CliRunner;"
            f"res = CliRunner().invoke(fsdpckpt.cli.main, ['inspect', {str(DCP_FOLDERS['dtensor'])!r}]);"
            "assert res.exit_code == 0, res.output;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
