"""A pickle from a checkpoint is read through an allowlist: hostile or garbage files are
refused, whatever reads them, and nothing runs.

Hostile ``.metadata`` at every entry point; garbage, empty and foreign pickles; protocol 2's
spellings of harmless builtins; state-setting opcodes (BUILD, SETITEM(S), APPEND(S),
ADDITEMS) on allowlisted globals, which must change nothing a later load sees; and the
``_codecs.encode``/``bytes`` stand-ins of torch.save's value pickles.
"""

from __future__ import annotations

import pickle

import pytest

import fsdpckpt
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS, safe_loads
from fsdpckpt.dcp.reader import parse_metadata, read_dcp_folder
from fsdpckpt.errors import NotACheckpointError, UnsafePickleError

from conftest import _RunsCommand, assert_one_line_error, hostile_pickle, run_cli


def _api(call):
    """An entry point of the Python API: the message of the UnsafePickleError it raises."""
    def refuse(folder, tmp_path):
        with pytest.raises(UnsafePickleError) as caught:
            call(folder)
        return str(caught.value)
    return refuse


def _cli(*args):
    """A CLI command: its one error line, after checking it is one line and exit 1."""
    def refuse(folder, tmp_path):
        result = run_cli(*[a.format(folder=folder, out=tmp_path / "out") for a in args])
        assert_one_line_error(result, folder / ".metadata")
        assert not (tmp_path / "out").exists()  # nothing written, not even the folder
        return result.stderr
    return refuse


def _storage_reader(folder):
    from fsdpckpt.training._dcp_io import safe_storage_reader

    return safe_storage_reader(folder)


# Every way a .metadata reaches the allowlist: the read side, the merge, inspection and
# verification, and the training load path's storage reader (refused at once, before torch).
_ENTRY_POINTS = {
    "read_dcp_folder": _api(read_dcp_folder),
    "inspect_checkpoint": _api(lambda f: fsdpckpt.inspect_checkpoint(f)),
    "verify_checkpoint": _api(lambda f: fsdpckpt.verify_checkpoint(f)),
    "load_full_state_dict": _api(lambda f: fsdpckpt.load_full_state_dict(f)),
    "training storage reader": _api(_storage_reader),
    "cli inspect": _cli("inspect", "{folder}"),
    "cli verify": _cli("verify", "{folder}"),
    "cli merge": _cli("merge", "{folder}", "{out}"),
    "cli merge-weights": _cli("merge-weights", "{folder}", "{out}"),
}


@pytest.mark.parametrize("entry_point", sorted(_ENTRY_POINTS))
def test_a_hostile_dot_metadata_is_refused_naming_it_and_never_runs(tmp_path, dtensor_copy,
                                                                     entry_point):
    sentinel = tmp_path / "pwned"
    (dtensor_copy / ".metadata").write_bytes(hostile_pickle(sentinel))
    message = _ENTRY_POINTS[entry_point](dtensor_copy, tmp_path)
    assert not sentinel.exists()
    assert str(dtensor_copy / ".metadata") in message
    assert "refusing to load the global" in message
    assert "posix.system" in message or "os.system" in message


def test_the_sentinel_pickle_really_is_hostile(tmp_path):
    # Guards the test above: plain pickle does run it.
    sentinel = tmp_path / "pwned"
    pickle.loads(hostile_pickle(sentinel))
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


# -- No pickle changes how the next file is read ----------------------------------------
#
# A pickle may name an allowlisted global and then apply a state-setting opcode to it:
# BUILD (dict state writes the object's __dict__, even of a frozen dataclass; slot state
# calls setattr, which reaches a function's __defaults__), or SETITEM(S)/APPEND(S)/ADDITEMS.
# Those objects are module-level and shared by every later load in the process, so each
# such pickle must be refused, and leave them exactly as they were.

import dataclasses  # noqa: E402
import pickletools  # noqa: E402

from fsdpckpt.dcp import _archive as archive  # noqa: E402
from fsdpckpt.dcp import _objects as objects  # noqa: E402
from fsdpckpt.dcp._safe_pickle import METADATA_GLOBALS  # noqa: E402
from fsdpckpt.dcp.dtypes import DTYPES  # noqa: E402

ALLOWLISTS = {
    "metadata": METADATA_GLOBALS,
    "tensor archive": archive._TENSOR_GLOBALS,
    "objects": objects._OBJECT_GLOBALS,
}


def _snapshot(value):
    """Everything a pickle could have changed on ``value``, as plain comparable data."""
    seen = {}
    for name in ("__dict__", "__defaults__", "__kwdefaults__"):
        attr = getattr(value, name, None)
        seen[name] = dict(attr) if isinstance(attr, dict) or type(attr).__name__ == \
            "mappingproxy" else attr
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen["fields"] = dataclasses.astuple(value)
    return repr(seen)


def _all_snapshots():
    return {(which, key): _snapshot(value) for which, allowed in ALLOWLISTS.items()
            for key, value in allowed.items()} | \
        {("dtype", name): _snapshot(d) for name, d in DTYPES.items()}


def _state_ops(state) -> bytes:
    """The opcodes pushing ``state`` (protocol 2, no PROTO header, no STOP, no memo writes,
    so that spliced into another pickle they leave its memo indices alone)."""
    return pickletools.optimize(pickle.dumps(state, protocol=2))[2:-1]


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


# What each state-setting opcode sends: dict state, slot state (setattr), and the
# container opcodes, each aimed at the global right below it on the stack.
_ATTACKS = {
    "BUILD dict state": lambda: _state_ops({"safetensors": "I32", "itemsize": 1,
                                            "kind": "x", "dtype": None}) + pickle.BUILD,
    "BUILD slot state": lambda: _state_ops((None, {"__defaults__": (1,), "dtype": None,
                                                   "itemsize": 1})) + pickle.BUILD,
    "SETITEM": lambda: _state_ops("k") + _state_ops(1) + pickle.SETITEM,
    "SETITEMS": lambda: pickle.MARK + _state_ops("k") + _state_ops(1) + pickle.SETITEMS,
    "APPEND": lambda: _state_ops(1) + pickle.APPEND,
    "APPENDS": lambda: pickle.MARK + _state_ops(1) + pickle.APPENDS,
    "ADDITEMS": lambda: pickle.MARK + _state_ops(1) + pickle.ADDITEMS,
}

_CASES = [pytest.param(which, key, id=f"{which}-{key[0]}.{key[1]}")
          for which, allowed in ALLOWLISTS.items() for key in allowed]


@pytest.mark.parametrize("which,key", _CASES)
def test_state_setting_opcodes_on_an_allowlisted_global_are_refused(which, key):
    before = _all_snapshots()
    for attack, ops in _ATTACKS.items():
        data = b"\x80\x02" + _global(*key) + ops() + pickle.STOP
        with pytest.raises(UnsafePickleError, match="refusing a pickle that changes") as caught:
            safe_loads(data, allowed=ALLOWLISTS[which], source="the/file")
        assert "\n" not in str(caught.value) and "the/file" in str(caught.value), attack
    assert _all_snapshots() == before


def test_build_on_a_value_an_allowlisted_function_returned_is_refused():
    # torch.Size returns a tuple, the storage rebuild a fresh record: neither is a
    # stand-in this file may set state on.
    data = (b"\x80\x02" + _global("torch", "Size") + _state_ops(((1, 2),)) + pickle.REDUCE +
            _state_ops({"x": 1}) + pickle.BUILD + pickle.STOP)
    with pytest.raises(UnsafePickleError, match="refusing a pickle that changes a tuple, "
                                                "which takes no state"):
        safe_loads(data, allowed=METADATA_GLOBALS, source="x")


class _StandIn:
    """A stand-in like the RNG reader's: built by a call, given state once by BUILD."""

    def __init__(self, *args):
        self.args, self.state = args, None

    def __setstate__(self, state):
        self.state = state


class _Plain:
    def __init__(self, *args):
        self.args = args


def test_build_goes_through_a_built_stand_in_s_own_setstate():
    allowed = {("m", "StandIn"): _StandIn}
    data = (b"\x80\x02" + _global("m", "StandIn") + _state_ops((1,)) + pickle.REDUCE +
            _state_ops({"k": 2}) + pickle.BUILD + pickle.STOP)
    got = safe_loads(data, allowed=allowed, source="x")
    assert isinstance(got, _StandIn) and got.args == (1,) and got.state == {"k": 2}


def test_build_never_writes_the_dict_of_a_built_object_without_setstate():
    allowed = {("m", "Plain"): _Plain}
    data = (b"\x80\x02" + _global("m", "Plain") + _state_ops((1,)) + pickle.REDUCE +
            _state_ops({"args": 2}) + pickle.BUILD + pickle.STOP)
    with pytest.raises(UnsafePickleError, match="a _Plain, which takes no state"):
        safe_loads(data, allowed=allowed, source="x")


def test_build_on_a_stand_in_class_itself_is_refused():
    before = _all_snapshots()
    data = (b"\x80\x02" + _global("torch.distributed.checkpoint.metadata", "Metadata") +
            _state_ops({"kind": "Metadata", "state_dict_metadata": {}}) + pickle.BUILD +
            pickle.STOP)
    with pytest.raises(UnsafePickleError, match="torch.distributed.checkpoint.metadata.Metadata"):
        safe_loads(data, allowed=METADATA_GLOBALS, source="x")
    assert _all_snapshots() == before


def test_state_setting_opcodes_still_fill_what_the_pickle_built():
    value = {"d": {1: 2}, "l": [1, 2], "s": {3}, "o": pickle.loads(pickle.dumps({"k": [1]}))}
    for protocol in (2, 4, 5):
        assert safe_loads(pickle.dumps(value, protocol=protocol), allowed=BUILTIN_GLOBALS,
                          source="x") == value


def test_a_record_keeps_its_kind_whatever_its_state_says():
    data = (b"\x80\x02" + _global("torch.distributed.checkpoint.metadata",
                                  "BytesStorageMetadata") + _state_ops(()) + pickle.NEWOBJ +
            _state_ops({"kind": "TensorStorageMetadata", "args": 1}) + pickle.BUILD + pickle.STOP)
    record = safe_loads(data, allowed=METADATA_GLOBALS, source="x")
    assert record.kind == "BytesStorageMetadata" and not hasattr(record, "args")


def _poisoned_metadata(folder) -> bytes:
    """The real ``.metadata`` of ``folder`` preceded by a BUILD onto ``torch.float32``.

    It stays a valid DCP pickle (the BUILD's result is popped), so only the BUILD is wrong.
    """
    real = (folder / ".metadata").read_bytes()
    attack = (_global("torch", "float32") + _state_ops({"safetensors": "I32"}) +
              pickle.BUILD + pickle.POP)
    assert real[:2] == b"\x80\x04"  # then the rest parses with any protocol's opcodes
    return real[:2] + attack + real[2:]


def test_inspecting_a_poisoned_folder_leaves_a_later_merge_bit_exact(tmp_path, dtensor_copy):
    # The issue's reproduction: after inspecting the crafted folder, a merge of a trusted
    # checkpoint in the same process wrote I32 headers over float32 data.
    import json
    import struct

    import fsdpckpt
    from fsdpckpt.merging.full import load_full_state_dict

    from conftest import DCP_FOLDERS, reference_state_dict, run_cli
    from deep_compare import assert_same_state

    (dtensor_copy / ".metadata").write_bytes(_poisoned_metadata(dtensor_copy))
    result = run_cli("inspect", dtensor_copy)
    assert result.exit_code == 1 and "refusing a pickle that changes" in result.stderr
    assert "torch.float32" in result.stderr
    assert DTYPES["float32"].safetensors == "F32" and DTYPES["float32"].itemsize == 4
    assert "safetensors" not in vars(DTYPES["float32"]) or \
        vars(DTYPES["float32"])["safetensors"] == "F32"

    trusted = DCP_FOLDERS["dtensor"]
    (merged,) = fsdpckpt.merge(trusted, tmp_path / "out", format="safetensors", keep_keys=True)
    raw = merged.path.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert "I32" not in {v.get("dtype") for k, v in header.items() if k != "__metadata__"}
    reference = reference_state_dict(trusted)
    expected = next(iter(reference.values())) if len(reference) == 1 else reference
    assert_same_state(load_full_state_dict(merged.path), expected)


def test_bytes_in_a_torch_save_value_still_load():
    from fsdpckpt.dcp._objects import _OBJECT_GLOBALS

    data = _torch_save_pickle({"b": b"\x00\xffabc", "e": b""})
    assert b"_codecs" in data
    assert safe_loads(data, allowed=_OBJECT_GLOBALS, source="x") == {"b": b"\x00\xffabc", "e": b""}


@pytest.mark.parametrize("codec", ["rot13", "punycode", "idna", "utf-16", "no-such-codec"])
def test_codecs_encode_accepts_only_latin1(codec):
    from fsdpckpt.dcp._objects import _OBJECT_GLOBALS
    from fsdpckpt.errors import NotACheckpointError

    data = (b"\x80\x02c_codecs\nencode\n" + _state_ops(("abc", codec)) + pickle.REDUCE +
            pickle.STOP)
    with pytest.raises(NotACheckpointError, match="latin1"):
        safe_loads(data, allowed=_OBJECT_GLOBALS, source="x")


@pytest.mark.parametrize("args", [(10**12,), (5,), ("abc", "latin1")])
def test_bytes_with_arguments_is_refused(args):
    from fsdpckpt.dcp._objects import _OBJECT_GLOBALS
    from fsdpckpt.errors import NotACheckpointError

    data = b"\x80\x02c__builtin__\nbytes\n" + _state_ops(args) + pickle.REDUCE + pickle.STOP
    with pytest.raises(NotACheckpointError, match="bytes"):
        safe_loads(data, allowed=_OBJECT_GLOBALS, source="x")


def test_an_unreadable_pickle_error_says_at_which_byte_it_failed():
    from fsdpckpt.errors import NotACheckpointError

    data = pickle.dumps({"a": [1, 2, 3]}, protocol=2)[:-4]
    with pytest.raises(NotACheckpointError, match=rf"at byte {len(data)} of {len(data)}"):
        safe_loads(data, allowed=BUILTIN_GLOBALS, source="x")


# -- a torch name the allowlist does not know: a newer torch, not "hostile" ---------------


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadataV2"),  # a renamed class
    ("torch", "float3_e1m1fn"),  # a dtype a later torch might add
    ("torch.distributed.checkpoint.filesystem", "_StorageInfoV2"),
])
def test_an_unknown_torch_global_says_a_newer_torch_may_have_written_the_file(module, name):
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"q\x00."
    with pytest.raises(UnsafePickleError) as caught:
        parse_metadata(data, source="the/.metadata")
    message = str(caught.value)
    assert f"{module}.{name}" in message
    assert "newer torch" in message and "upgrade fsdpckpt" in message
    assert "may be hostile" not in message


@pytest.mark.parametrize("module", ["os", "torchvision.io", "torchy"])
def test_an_unknown_global_outside_torch_keeps_the_hostile_message(module):
    data = b"\x80\x02c" + f"{module}\nsystem\n".encode() + b"q\x00."
    with pytest.raises(UnsafePickleError, match="may be hostile") as caught:
        parse_metadata(data, source="the/.metadata")
    assert "newer torch" not in str(caught.value)
