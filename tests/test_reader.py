"""Reading a DCP folder's ``.metadata`` without torch: what it gives agrees with torch's own
FileSystemReader on every fixture (tensors, chunks, objects, key paths, order, any pickle
protocol); a memo index the file declares never drives an allocation; and the decoded
metadata is checked field by field, each error naming the entry and the field."""

from __future__ import annotations

import json
import pickle

import pytest
from click.testing import CliRunner
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from fsdpckpt.cli import main
from fsdpckpt.dcp.reader import parse_metadata, read_dcp_folder


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

    code = ("import sys, fsdpckpt.cli, fsdpckpt.dcp.reader as r;"
            f"r.read_dcp_folder({str(DCP_FOLDERS['dtensor'])!r});"
            "from click.testing import CliRunner;"
            "res = CliRunner().invoke(fsdpckpt.cli.main, "
            f"['inspect', {str(DCP_FOLDERS['dtensor'])!r}]);"
            "assert res.exit_code == 0, res.output;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- Bounded work: a memo index is a number the file declares ----------------------------

_MEMO_PROBE = """
import json, sys, time
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.dcp.reader import read_dcp_folder

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

before, start = peak_kib(), time.perf_counter()
try:
    read_dcp_folder(sys.argv[1])
    error = None
except FsdpCkptError as exc:
    error = type(exc).__name__
print(json.dumps({"error": error, "grew_kib": peak_kib() - before,
                  "seconds": time.perf_counter() - start}))
"""


@pytest.mark.parametrize("opcode", [b"r", b"j"], ids=["LONG_BINPUT", "LONG_BINGET"])
@pytest.mark.parametrize("index", [0x07FFFFFF, 0xFFFFFFFF])
def test_a_huge_memo_index_is_refused_fast_and_small(tmp_path, opcode, index):
    # 9 bytes: PROTO 4, NONE, LONG_BINPUT/LONG_BINGET <index>, STOP. pickle's C unpickler
    # grows its memo array to the index (11.6 s and 7.8 GB for one such file).
    import subprocess
    import sys

    data = b"\x80\x04N" + opcode + index.to_bytes(4, "little") + b"."
    assert len(data) == 9
    (tmp_path / ".metadata").write_bytes(data)
    out = subprocess.run([sys.executable, "-c", _MEMO_PROBE, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["error"] == "NotACheckpointError"
    assert result["grew_kib"] < 100 * 1024
    assert result["seconds"] < 5


# -- The decoded metadata is checked against a schema, field by field ---------------------

def _damaged(field):
    """A mutation of torch's Metadata object that breaks ``field`` (type or range)."""
    import torch

    def first_tensor(md):
        return next(v for v in md.state_dict_metadata.values()
                    if not isinstance(v, BytesStorageMetadata) and len(v.size))

    def first_info(md):
        return next(iter(md.storage_data.values()))

    def set_first_key(md, make):
        key, value = next(iter(md.state_dict_metadata.items()))
        md.state_dict_metadata = {make(key): value}

    return {
        "offsets a string": lambda md: setattr(first_tensor(md).chunks[0], "offsets", "0,0"),
        "offsets a function": lambda md: setattr(first_tensor(md).chunks[0], "offsets",
                                                 torch.Size),
        "offsets a float": lambda md: setattr(first_tensor(md).chunks[0], "offsets", (0.5, 0)),
        "offsets a bool": lambda md: setattr(first_tensor(md).chunks[0], "offsets", (True,)),
        "sizes negative": lambda md: setattr(first_tensor(md).chunks[0], "sizes",
                                             torch.Size([-1] * len(first_tensor(md).size))),
        "offsets and sizes of unequal length": lambda md: setattr(
            first_tensor(md).chunks[0], "offsets", torch.Size([0] * 7)),
        "chunk not a chunk": lambda md: first_tensor(md).chunks.__setitem__(0, 3),
        "chunks an int": lambda md: setattr(first_tensor(md), "chunks", 3),
        "shape negative": lambda md: setattr(first_tensor(md), "size", torch.Size([-4])),
        "shape past int64": lambda md: setattr(first_tensor(md), "size", (2**63,)),
        "properties missing": lambda md: setattr(first_tensor(md), "properties", None),
        "file offset a string": lambda md: setattr(first_info(md), "offset", "12"),
        "file length negative": lambda md: setattr(first_info(md), "length", -5),
        "relative_path an int": lambda md: setattr(first_info(md), "relative_path", 5),
        "storage index fqn an int":
            lambda md: object.__setattr__(next(iter(md.storage_data)), "fqn", 5),
        "planner key path with a float": lambda md: md.planner_data.__setitem__(
            next(iter(md.state_dict_metadata)), ("model", 1.5)),
        "planner key path an int": lambda md: md.planner_data.__setitem__(
            next(iter(md.state_dict_metadata)), 7),
        "planner key path with a negative index": lambda md: md.planner_data.__setitem__(
            next(iter(md.state_dict_metadata)), ("model", -1)),
        "planner_data a list": lambda md: setattr(md, "planner_data", [1]),
        "state_dict_metadata a list": lambda md: setattr(md, "state_dict_metadata", []),
        "storage_data an int": lambda md: setattr(md, "storage_data", 5),
        "entry name an int": lambda md: set_first_key(md, lambda key: 5),
        "version an int": lambda md: setattr(md, "version", 1),
        "storage_meta an int": lambda md: setattr(md, "storage_meta", 5),
    }[field]


_FIELDS = ["offsets a string", "offsets a function", "offsets a float", "offsets a bool",
           "sizes negative", "offsets and sizes of unequal length", "chunk not a chunk",
           "chunks an int", "shape negative", "shape past int64", "properties missing",
           "file offset a string", "file length negative", "relative_path an int",
           "storage index fqn an int", "planner key path with a float",
           "planner key path an int", "planner key path with a negative index",
           "planner_data a list", "state_dict_metadata a list", "storage_data an int",
           "entry name an int", "version an int", "storage_meta an int"]


@pytest.mark.parametrize("field", _FIELDS)
def test_a_mistyped_or_out_of_range_field_is_not_a_checkpoint(field):
    from fsdpckpt.errors import NotACheckpointError

    from conftest import DCP_FOLDERS

    md = FileSystemReader(str(DCP_FOLDERS["fsdp2-optimizer"])).read_metadata()
    _damaged(field)(md)
    with pytest.raises(NotACheckpointError) as caught:
        parse_metadata(pickle.dumps(md), source="the/.metadata")
    message = str(caught.value)
    assert message.startswith("the/.metadata: ") and "\n" not in message
    assert "not a readable pickle" not in message  # it names the field instead


def test_a_field_error_names_the_entry_and_the_field():
    from fsdpckpt.errors import NotACheckpointError

    from conftest import DCP_FOLDERS

    md = FileSystemReader(str(DCP_FOLDERS["dtensor"])).read_metadata()
    name, entry = next((k, v) for k, v in md.state_dict_metadata.items()
                       if not isinstance(v, BytesStorageMetadata))
    entry.chunks[1].sizes = "12"
    with pytest.raises(NotACheckpointError, match=rf"tensor '{name}': chunk 1: sizes is '12', "
                                                  "not a tuple of integers"):
        parse_metadata(pickle.dumps(md), source="x")


def test_an_error_message_quotes_a_huge_value_briefly():
    from fsdpckpt.errors import NotACheckpointError

    from conftest import DCP_FOLDERS

    md = FileSystemReader(str(DCP_FOLDERS["dtensor"])).read_metadata()
    next(iter(md.storage_data.values())).relative_path = 10 ** 5000  # its repr raises
    expected = "relative_path is <a 16610-bit integer>, not a string"
    with pytest.raises(NotACheckpointError, match=expected) as caught:
        parse_metadata(pickle.dumps(md), source="x")
    assert len(str(caught.value)) < 400
