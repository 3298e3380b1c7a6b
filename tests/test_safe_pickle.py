"""A .metadata file is read through an allowlist: hostile or garbage files are refused."""

from __future__ import annotations

import pickle

import pytest

from fsdpckpt.errors import NotACheckpointError, UnsafePickleError
from fsdpckpt.reader import parse_metadata, read_dcp_folder
from fsdpckpt.safe_pickle import BUILTIN_GLOBALS, safe_loads


from conftest import _RunsCommand, hostile_pickle


def test_hostile_metadata_never_runs(tmp_path, dtensor_copy):
    sentinel = tmp_path / "pwned"
    (dtensor_copy / ".metadata").write_bytes(hostile_pickle(sentinel))
    with pytest.raises(UnsafePickleError) as caught:
        read_dcp_folder(dtensor_copy)
    assert not sentinel.exists()
    message = str(caught.value)
    assert str(dtensor_copy / ".metadata") in message
    assert "posix.system" in message or "os.system" in message


def test_the_sentinel_pickle_really_is_hostile(tmp_path):
    # Guards the test above: plain pickle does run it.
    sentinel = tmp_path / "pwned"
    pickle.loads(hostile_pickle(sentinel))  # noqa: S301 - the point of the test
    assert sentinel.exists()


def test_hostile_global_hidden_inside_real_metadata_is_refused(tmp_path, dtensor_copy):
    from torch.distributed.checkpoint import FileSystemReader

    sentinel = tmp_path / "pwned"
    md = FileSystemReader(str(dtensor_copy)).read_metadata()
    md.planner_data["step"] = _RunsCommand(f"touch {sentinel}")
    with pytest.raises(UnsafePickleError):
        parse_metadata(pickle.dumps(md), source="x")
    assert not sentinel.exists()


def test_unsafe_error_is_also_an_unpickling_error():
    with pytest.raises(pickle.UnpicklingError):
        safe_loads(pickle.dumps(print), allowed=BUILTIN_GLOBALS, source="x")


@pytest.mark.parametrize("data", [b"garbage\x00\x01", b"\x80\x04", pickle.dumps([1, 2])[:-1]])
def test_garbage_metadata_is_not_a_checkpoint(data):
    with pytest.raises(NotACheckpointError, match="not a readable pickle"):
        parse_metadata(data, source="the/.metadata")


def test_empty_metadata_says_the_save_did_not_finish():
    with pytest.raises(NotACheckpointError, match="empty"):
        parse_metadata(b"", source="x")


def test_a_pickle_of_something_else_is_not_dcp_metadata():
    with pytest.raises(NotACheckpointError, match="not DCP checkpoint metadata"):
        parse_metadata(pickle.dumps({"model": 1}), source="x")


def test_plain_builtins_load():
    assert safe_loads(pickle.dumps({"a": (1, 2.5, "x", None, True)}), allowed=BUILTIN_GLOBALS,
                      source="x") == {"a": (1, 2.5, "x", None, True)}


def _torch_save_pickle(value) -> bytes:
    """The data.pkl torch.save writes for ``value`` (pickle protocol 2)."""
    import io
    import zipfile

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def test_protocol_2_spellings_of_harmless_builtins_load():
    # Protocol 2 names builtins as Python 2 did: __builtin__.set, __builtin__.complex.
    data = _torch_save_pickle({"s": {1, 2}, "f": frozenset({"a"}), "c": 1 + 2j, "sl": slice(1, 4)})
    assert b"__builtin__" in data
    assert safe_loads(data, allowed=BUILTIN_GLOBALS, source="x") == \
        {"s": {1, 2}, "f": frozenset({"a"}), "c": 1 + 2j, "sl": slice(1, 4)}


@pytest.mark.parametrize("name", ["eval", "exec", "getattr", "open", "__import__"])
def test_other_protocol_2_builtins_stay_refused(name):
    data = b"\x80\x02c__builtin__\n" + name.encode() + b"\nq\x00."
    with pytest.raises(UnsafePickleError, match=f"__builtin__.{name}"):
        safe_loads(data, allowed=BUILTIN_GLOBALS, source="x")
