"""Every pickle is walked before it is built: one reading, bounded keys and nesting.

What a checkpoint's pickle builds must be what torch's own reader builds, and nothing it
builds may crash, hang or exhaust the reader. Each hostile pickle here is one the readers
got wrong before the walks of ``dcp/_pickle_walk.py``: an argument crossing a frame's end
(pickle's C reader fed from memory and the one reading a file see other opcodes), a dict
key nested 300,000 tuples deep (the hash recursion segfaults every unpickler), a key of
shared tuples (hours to hash), integer keys that all hash alike (quadratic). The crashing
ones run in a child process, so a regression is a failed test, not a dead suite.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from fsdpckpt.dcp._allowlist import METADATA_GLOBALS
from fsdpckpt.dcp._fast_pickle import fast_loads
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS, safe_loads
from fsdpckpt.dcp.reader import parse_metadata
from fsdpckpt.errors import NotACheckpointError, UnsafePickleError

from conftest import DCP_FOLDERS, FIXTURES

#: A frame whose last string runs past its end: read straight through (pickle.loads, and
#: torch's pickle.load of the file) it is '1.0.0'; pickle's C reader fed a BytesIO drops
#: the rest of the frame and reads '.0.0t'.
FRAME_CROSSING = b"\x95\x08\x00\x00\x00\x00\x00\x00\x00\x80\x04(\x8c\x051.0.0.0t.0"


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsdpckpt", *args], capture_output=True,
                          text=True, timeout=timeout)


def _one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdpckpt: error:"), result.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _folder_with_metadata(tmp_path: Path, data: bytes) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(data)
    for rank_file in DCP_FOLDERS["dtensor"].glob("*.distcp"):
        (folder / rank_file.name).write_bytes(rank_file.read_bytes())
    return folder


def _deep_key(depth: int) -> bytes:
    """``{((...(None,)...),): None}``: a key ``depth`` tuples deep, 1 byte a level."""
    return b"\x80\x04}N" + b"\x85" * depth + b"Ns."


def _shared_key(levels: int) -> bytes:
    """A key of ``levels`` tuples, each holding the one below twice: 2**levels to hash."""
    ops = b"N\x940"  # each level memoized, then popped: the stack holds only the dict
    for level in range(levels):
        ops += b"h" + bytes([level]) + b"h" + bytes([level]) + b"\x86\x940"
    return b"\x80\x04}" + ops + b"h" + bytes([levels]) + b"Ns."


def _colliding_keys(count: int) -> bytes:
    """A dict of ``count`` integer keys ``k * (2**61 - 1)``: every one hashes to 0."""
    body = b"".join(pickle.dumps(k * ((1 << 61) - 1), protocol=4)[2:-1] + b"N"
                    for k in range(1, count + 1))
    return b"\x80\x04}(" + body + b"u."


# -- one reading -------------------------------------------------------------------------

def test_the_frame_crossing_pickle_reads_two_ways():
    # The attack itself: two of pickle's own readers disagree on these bytes.
    assert pickle.loads(FRAME_CROSSING) == "1.0.0"
    assert pickle.Unpickler(io.BytesIO(FRAME_CROSSING)).load() == ".0.0t"


@pytest.mark.parametrize("loads", [fast_loads, safe_loads], ids=["c", "pure"])
def test_an_argument_crossing_a_frames_end_is_refused(loads):
    with pytest.raises(NotACheckpointError, match="by the end of its frame"):
        loads(FRAME_CROSSING, allowed=METADATA_GLOBALS, source="x")


def _reframed(data: bytes, split_inside: bytes) -> bytes:
    """``data`` unframed, then one frame from the start that ends inside the first
    SHORT_BINUNICODE argument equal to ``split_inside``."""
    ops = [(op, arg, pos) for op, arg, pos in pickletools.genops(data)]
    plain = bytearray()
    cut = None
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        if op.name == "FRAME":
            continue
        if cut is None and op.name == "SHORT_BINUNICODE" and arg == split_inside:
            cut = len(plain) + 3
        plain += data[pos:end]
    assert cut is not None
    return b"\x95" + cut.to_bytes(8, "little") + bytes(plain)


def test_a_metadata_whose_frame_ends_inside_a_name_is_refused_by_every_verb(tmp_path):
    honest = (DCP_FOLDERS["dtensor"] / ".metadata").read_bytes()
    name = next(arg for op, arg, _ in pickletools.genops(honest)
                if op.name == "SHORT_BINUNICODE" and len(arg) > 8)
    data = _reframed(honest, name)
    folder = _folder_with_metadata(tmp_path, data)
    for verb in ("inspect", "verify"):
        _one_error_line(_cli(verb, str(folder)), ".metadata", "frame")
    with pytest.raises(NotACheckpointError, match="frame"):
        parse_metadata(data, source="x")


def test_a_frame_inside_a_frame_is_refused():
    inner = b"\x80\x04\x95\x01\x00\x00\x00\x00\x00\x00\x00N"
    data = b"\x95" + len(inner).to_bytes(8, "little") + inner + b"."
    with pytest.raises(NotACheckpointError, match="inside another frame"):
        fast_loads(data, allowed=METADATA_GLOBALS, source="x")


def test_honest_frames_still_read():
    value = {"a" * 70_000: list(range(20_000)), "b": "x" * 200_000}
    data = pickle.dumps(value, protocol=4)
    assert fast_loads(data, allowed=METADATA_GLOBALS, source="x") == value
    assert safe_loads(data, allowed=BUILTIN_GLOBALS, source="x") == value


# -- keys that crash or hang the hash, in .metadata ---------------------------------------

@pytest.mark.parametrize("data, what", [
    (_deep_key(300_000), "tuples nested"),
    (_shared_key(60), "a dict key is a tuple"),
    (_colliding_keys(40_000), "a dict key is a float or large integer"),
], ids=["deep", "shared", "colliding"])
def test_a_metadata_whose_keys_cannot_be_hashed_safely_is_refused_in_seconds(
        tmp_path, data, what):
    folder = _folder_with_metadata(tmp_path, data)
    started = time.monotonic()
    _one_error_line(_cli("inspect", str(folder), timeout=60), ".metadata", what)
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("loads", [fast_loads, safe_loads], ids=["c", "pure"])
def test_both_readers_refuse_a_tuple_key_before_hashing_it(loads):
    data = pickle.dumps({(1, 2): 3}, protocol=4)
    with pytest.raises(NotACheckpointError, match="a dict key is a tuple"):
        loads(data, allowed=METADATA_GLOBALS, source="x")


@pytest.mark.parametrize("loads", [fast_loads, safe_loads], ids=["c", "pure"])
def test_a_set_of_tuples_is_refused_before_hashing(loads):
    with pytest.raises(NotACheckpointError, match="set member"):
        loads(pickle.dumps(frozenset({(1, 2)}), protocol=4), allowed=METADATA_GLOBALS,
              source="x")


def test_a_protocol_2_set_is_checked_before_it_hashes():
    # builtins.set called on a list: the walk knows what the list holds.
    data = pickle.dumps({(1, 2)}, protocol=2)
    with pytest.raises(NotACheckpointError, match="builtin__.set, which hashes what it is given"):
        safe_loads(data, allowed=BUILTIN_GLOBALS, source="x")


@pytest.mark.parametrize("name", ["set", "frozenset"])
def test_the_set_a_pickle_calls_checks_its_members_itself(name):
    # What a .metadata past the walk's bound (scan only) still has between it and the hash.
    make = METADATA_GLOBALS[("builtins", name)]
    assert make([1, "a"]) == {1, "a"}
    with pytest.raises(pickle.UnpicklingError, match=f"a {name} holds a tuple"):
        make([(1, 2)])


# The forms a long review found torch's own loader hashing, each with a key of 60 levels of
# shared tuples (hours to hash): a list holding t0..t60, t_i = (t_{i-1}, t_{i-1}).
_CHAIN = b"](" + b")q\x00" + b"h\x00h\x00\x86q\x00" * 60 + b"e"


_TORCH_HASHES = {
    "OrderedDict": _CHAIN + b"ccollections\nOrderedDict\n](h\x00K\x01\x86e\x85R.",
    "Counter": _CHAIN + b"ccollections\nCounter\n](h\x00e\x85R.",
    "set": _CHAIN + b"cbuiltins\nset\n](h\x00e\x85R.",
    "_get_layout": _CHAIN + b"ctorch.serialization\n_get_layout\nh\x00\x85R.",
    "OrderedDict-BUILD": _CHAIN + b"ccollections\nOrderedDict\n)R](h\x00K\x01\x86eb.",
    "colliding-set": b"cbuiltins\nset\n](" + b"".join(
        b"\x8a\x09" + (k * ((1 << 61) - 1)).to_bytes(9, "little", signed=True)
        for k in range(1, 60)) + b"e\x85R.",
}


def test_what_torchs_loader_would_hash_is_refused_before_it_reads(tmp_path):
    # One child for all six (each a .bin load_full_state_dict hands torch.load): a hang or
    # a crash fails the test, not the suite.
    for name, body in _TORCH_HASHES.items():
        _raw_torch_save(tmp_path / f"{name}.bin", b"\x80\x02" + body)
    script = (
        "import sys, fsdpckpt\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        fsdpckpt.load_full_state_dict(path)\n"
        "        print('LOADED', path)\n"
        "    except fsdpckpt.NotACheckpointError as exc:\n"
        "        print('REFUSED', 'not a readable pickle' in str(exc), path)\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script, *(
        str(tmp_path / f"{name}.bin") for name in _TORCH_HASHES)], capture_output=True,
        text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines() == [
        f"REFUSED True {tmp_path / name}.bin" for name in _TORCH_HASHES], result.stdout
    assert time.monotonic() - started < 30


def test_tuples_nested_past_the_bound_are_refused_as_values_too():
    data = b"\x80\x04N" + b"\x85" * 100 + b"."
    with pytest.raises(NotACheckpointError, match="tuples nested more than 64 deep"):
        safe_loads(data, allowed=BUILTIN_GLOBALS, source="x")


def test_keys_torch_writes_still_read():
    value = {"a": 1, 3: "b", -4: None, True: "c", None: 2.5, (1 << 61) - 2: 0}
    for protocol in (2, 4):
        data = pickle.dumps(value, protocol=protocol)
        assert safe_loads(data, allowed=BUILTIN_GLOBALS, source="x") == value
        assert fast_loads(data, allowed=METADATA_GLOBALS, source="x") == value


# -- the same in a side file: torch.save archives -----------------------------------------

def _raw_torch_save(path: Path, pickle_bytes: bytes) -> None:
    """A torch.save archive whose data.pkl is ``pickle_bytes``, written by torch itself."""
    import torch

    class RawPickler:
        def __init__(self, file, protocol=None):
            self.file = file

        def dump(self, obj):
            self.file.write(obj)

    module = types.ModuleType("raw_pickle")
    module.Pickler = RawPickler  # type: ignore[attr-defined]
    torch.save(pickle_bytes, path, pickle_module=module)


@pytest.mark.parametrize("data", [
    b"\x80\x02}N" + b"\x85" * 300_000 + b"Ns.",
    _shared_key(60).replace(b"\x80\x04", b"\x80\x02", 1).replace(b"\x94", b"q\x00"),
], ids=["deep", "shared"])
def test_a_scheduler_file_whose_keys_cannot_be_hashed_is_refused(accelerate_ckpt, data):
    if b"q\x00" in data:  # protocol 2 memoizes by BINPUT: number the entries
        parts = data.split(b"q\x00")
        data = parts[0] + b"".join(b"q" + bytes([i]) + part for i, part in enumerate(parts[1:]))
    _raw_torch_save(accelerate_ckpt / "scheduler.bin", data)
    started = time.monotonic()
    result = _cli("verify", str(accelerate_ckpt), timeout=60)
    assert time.monotonic() - started < 20
    _one_error_line(result, "1 problem found")
    problem = [line for line in result.stdout.splitlines() if "scheduler.bin" in line]
    assert problem and "not a readable pickle" in problem[0], result.stdout


def test_the_honest_fixtures_walk():
    for path in sorted(FIXTURES.glob("**/.metadata")):
        parse_metadata(path.read_bytes(), source=str(path))


# -- bytes handed to torch's own reader are walked first ------------------------------

def test_a_bin_whose_pickle_torch_would_crash_on_is_refused_before_torch_reads_it(tmp_path):
    # load_full_state_dict and convert hand a .bin to torch.load(weights_only=True), whose
    # unpickler hashes keys as unguarded as pickle's: a deep key segfaulted it.
    _raw_torch_save(tmp_path / "model.bin", b"\x80\x02}N" + b"\x85" * 300_000 + b"Ns.")
    _one_error_line(_cli("convert", str(tmp_path / "model.bin"), str(tmp_path / "dcp")),
                    "model.bin", "tuples nested")
    assert not (tmp_path / "dcp").exists()


def test_a_legacy_bin_is_walked_too(tmp_path):
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    honest = (tmp_path / "old.bin").read_bytes()
    # The object pickle (the fourth) swapped for a dict keyed by a deep tuple.
    pos = 0
    for _ in range(3):
        pos += [p for _, _, p in pickletools.genops(honest[pos:])][-1] + 1
    end = pos + [p for _, _, p in pickletools.genops(honest[pos:])][-1] + 1
    hostile = honest[:pos] + b"\x80\x02}N" + b"\x85" * 300_000 + b"Ns." + honest[end:]
    (tmp_path / "old.bin").write_bytes(hostile)
    _one_error_line(_cli("convert", str(tmp_path / "old.bin"), str(tmp_path / "dcp")),
                    "old.bin", "tuples nested")


# -- both readers refuse alike -----------------------------------------------------------

@pytest.mark.parametrize("data", [
    b"\x80\x04\x8c\x01aNNs.",  # SETITEM aimed at a string
    b"\x80\x04N]a.",  # APPEND aimed at None
    b"\x80\x04\x8c\x01a}b.",  # BUILD on a string
    b"\x80\x04)(Ne.",  # APPENDS onto a tuple
], ids=["setitem-str", "append-none", "build-str", "appends-tuple"])
def test_a_state_setting_opcode_aimed_at_a_literal_is_refused_alike(data):
    for loads in (fast_loads, safe_loads):
        with pytest.raises(UnsafePickleError, match="which takes no state"):
            loads(data, allowed=METADATA_GLOBALS, source="x")


def test_a_global_outside_the_allowlist_is_named_before_what_follows_it():
    data = b"\x80\x04cos\nsystem\n}N\x85\x85Ns."  # then a tuple key
    for loads in (fast_loads, safe_loads):
        with pytest.raises(UnsafePickleError, match="'os.system'"):
            loads(data, allowed=METADATA_GLOBALS, source="x")


def test_a_state_dict_with_its_metadata_still_converts(tmp_path):
    # torch.save of a module's state_dict() gives its OrderedDict a _metadata by BUILD:
    # the walk before torch's loader leaves what BUILD may change to torch.
    import torch

    state = torch.nn.Linear(3, 2).state_dict()
    assert hasattr(state, "_metadata")
    torch.save(state, tmp_path / "model.bin")
    result = _cli("convert", str(tmp_path / "model.bin"), str(tmp_path / "dcp"))
    assert result.returncode == 0, result.stderr
