"""RNG files are decoded exactly by fsdpckpt's own unpickler.

Real files (Accelerate's, HF Trainer's, our own) round-trip; anything else is one line.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsdpckpt
from fsdpckpt.training._rng import load_rng_file, rng_state_bytes

from deep_compare import assert_same_numpy_state
from fuzzing import damaged, fuzz_settings


def _save(path: Path, state) -> Path:
    torch.save(state, path)
    return path


def _real_state(step: int = 3) -> dict:
    return {"step": step, "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(), "torch_manual_seed": torch.get_rng_state()}


def _refused(path: Path, error=fsdpckpt.NotACheckpointError, *words: str) -> str:
    """Load ``path``, expect ``error`` in one line naming the file and ``words``."""
    with pytest.raises(error) as caught:
        load_rng_file(path)
    message = str(caught.value)
    assert "\n" not in message and path.name in message
    for word in words:
        assert word in message
    return message


# --- real files round-trip ---------------------------------------------------------------------

def test_a_file_written_by_accelerates_own_save_round_trips(tmp_path, monkeypatch):
    from accelerate import checkpointing

    # Accelerate's logger insists on an initialized accelerator; the RNG part needs none.
    monkeypatch.setattr(checkpointing, "logger", logging.getLogger("accelerate-test"))
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    np.random.standard_normal()  # leaves a cached gaussian behind in numpy's state
    expected = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    checkpointing.save_accelerator_state(str(tmp_path), [], [], [], [], 0, 11)

    state = load_rng_file(tmp_path / "random_states_0.pkl")
    assert state["step"] == 11
    assert state["random_state"] == expected[0]
    assert_same_numpy_state(state["numpy_random_seed"], expected[1])
    assert torch.equal(state["torch_manual_seed"], expected[2])
    assert set(state) <= {"step", "random_state", "numpy_random_seed", "torch_manual_seed",
                          "torch_cuda_manual_seed"}


def test_a_file_written_by_the_capture_code_round_trips(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    expected = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(rng_state_bytes(9))

    state = load_rng_file(path)
    assert state["step"] == 9 and state["random_state"] == expected[0]
    assert_same_numpy_state(state["numpy_random_seed"], expected[1])
    assert torch.equal(state["torch_manual_seed"], expected[2])


def test_hf_trainers_layout_round_trips_under_accelerates_keys(tmp_path):
    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    random.gauss(0, 1)  # python's state with a cached gaussian (a float, not None)
    saved = {"python": random.getstate(), "numpy": np.random.get_state(),
             "cpu": torch.get_rng_state(), "cuda": []}
    state = load_rng_file(_save(tmp_path / "rng_state_0.pth", saved))

    assert state["random_state"] == saved["python"]
    assert_same_numpy_state(state["numpy_random_seed"], saved["numpy"])
    assert torch.equal(state["torch_manual_seed"], saved["cpu"])
    assert state["torch_cuda_manual_seed"] == []


def test_gpu_states_come_back_as_byte_tensors(tmp_path):
    gpus = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    state = load_rng_file(_save(tmp_path / "r.pkl", {**_real_state(),
                                                     "torch_cuda_manual_seed": gpus}))
    assert all(torch.equal(a, b) for a, b in zip(state["torch_cuda_manual_seed"], gpus))


def test_restored_numpy_state_drives_numpy_exactly(tmp_path):
    np.random.seed(8)
    path = _save(tmp_path / "r.pkl", _real_state())
    expected = np.random.rand(4)
    np.random.seed(0)
    np.random.set_state(load_rng_file(path)["numpy_random_seed"])
    assert np.array_equal(np.random.rand(4), expected)


def test_the_numpy_key_is_a_writable_array_of_its_own(tmp_path):
    key = load_rng_file(_save(tmp_path / "r.pkl", _real_state()))["numpy_random_seed"][1]
    assert key.flags.writeable and key.flags.owndata and key.flags.c_contiguous


def test_neither_torch_load_nor_numpy_unpickling_is_used(tmp_path, monkeypatch):
    path = _save(tmp_path / "r.pkl", _real_state())

    def forbidden(*_args, **_kwargs):
        raise AssertionError("must not be called on an RNG file")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(np._core.multiarray, "_reconstruct", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    assert "numpy_random_seed" in load_rng_file(path)


def test_without_numpy_the_numpy_state_is_skipped_with_a_warning(tmp_path, monkeypatch):
    path = _save(tmp_path / "r.pkl", _real_state())
    monkeypatch.setitem(sys.modules, "numpy", None)  # "import numpy" now fails
    with pytest.warns(UserWarning, match="r.pkl.*numpy is not installed"):
        state = load_rng_file(path)
    assert "numpy_random_seed" not in state and "torch_manual_seed" in state


# --- the crafted object-dtype file ------------------------------------------------------------

def _text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _latin1(s: str) -> bytes:
    return b"c_codecs\nencode\n" + _text(s) + _text("latin1") + b"\x86R"


def _object_dtype_file() -> bytes:
    """A torch.save archive whose numpy key is rebuilt over raw bytes with an object dtype.

    ``_reconstruct(ndarray, (0,), b"b")`` then BUILD with an int64 dtype made, by its own
    BUILD, into a subarray of the object dtype: numpy then treats the 8 bytes ``AAAAAAAA``
    as a pointer, and touching the array (its repr) kills the process with SIGSEGV.
    """
    objects = b"cnumpy\ndtype\n" + _text("O8") + b"\x89\x88\x87R"
    dtype = (b"cnumpy\ndtype\n" + _text("i8") + b"\x89\x88\x87R"
             + b"(K\x03" + _text("|") + b"(" + objects + b"K\x01\x85tNNK\x08K\x08K\x00tb")
    array = (b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _latin1("b")
             + b"\x87R(K\x01K\x01\x85" + dtype + b"\x89" + _latin1("A" * 8) + b"tb")
    pkl = (b"\x80\x02}(" + _text("numpy_random_seed") + b"(" + _text("MT19937") + array
           + b"K\x00K\x00G" + struct.pack(">d", 0.0) + b"t" + _text("random_state") + b"Nu.")
    return _archive(pkl)


def _archive(pkl: bytes, **extra: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pkl)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")
        for name, data in extra.items():
            archive.writestr(f"archive/{name}", data)
    return buffer.getvalue()


def test_the_crafted_object_dtype_file_is_refused_in_one_line_and_does_not_crash(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(_object_dtype_file())
    # A child process: should numpy ever get to the bytes, the crash must not take pytest.
    script = ("import sys; from pathlib import Path\n"
              "from fsdpckpt.training._rng import load_rng_file\n"
              "state = load_rng_file(Path(sys.argv[1])); print(repr(state))\n")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert result.returncode != -11 and result.returncode != 139, "numpy crashed the process"
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("fsdpckpt.errors.NotACheckpointError: ")
    assert "random_states_0.pkl" in last and "numpy_random_seed" in last and "uint32" in last


# --- every malformed field is one line naming the field ---------------------------------------

def _numpy_with(index: int, value):
    def change(state: dict) -> dict:
        numpy_state = list(state["numpy_random_seed"])
        numpy_state[index] = value
        return {**state, "numpy_random_seed": tuple(numpy_state)}
    return change


def _python_with(version=3, words=None, gauss=None):
    def change(state: dict) -> dict:
        return {**state, "random_state": (version, words if words is not None else
                                          state["random_state"][1], gauss)}
    return change


def _replace(key, value):
    return lambda state: {**state, key: value}


_WORDS = tuple(range(624)) + (624,)
_KEY = np.arange(624, dtype=np.uint32)

BAD_FIELDS = {
    "numpy-key-uint64": (_numpy_with(1, _KEY.astype(np.uint64)), "numpy_random_seed"),
    "numpy-key-int32": (_numpy_with(1, _KEY.astype(np.int32)), "numpy_random_seed"),
    "numpy-key-float32": (_numpy_with(1, _KEY.astype(np.float32)), "numpy_random_seed"),
    "numpy-key-big-endian": (_numpy_with(1, _KEY.astype(">u4")), "numpy_random_seed"),
    "numpy-key-623-long": (_numpy_with(1, _KEY[:623].copy()), "numpy_random_seed"),
    "numpy-key-625-long": (_numpy_with(1, np.arange(625, dtype=np.uint32)), "numpy_random_seed"),
    "numpy-key-2d": (_numpy_with(1, _KEY.reshape(24, 26)), "numpy_random_seed"),
    "numpy-key-2d-fortran": (_numpy_with(1, np.asfortranarray(_KEY.reshape(24, 26))),
                             "numpy_random_seed"),
    "numpy-key-object": (_numpy_with(1, _KEY.astype(object)), "numpy_random_seed"),
    "numpy-key-a-list": (_numpy_with(1, list(range(624))), "numpy_random_seed"),
    "numpy-generator-name": (_numpy_with(0, "PCG64"), "numpy_random_seed"),
    "numpy-pos-625": (_numpy_with(2, 625), "numpy_random_seed"),
    "numpy-pos-negative": (_numpy_with(2, -1), "numpy_random_seed"),
    "numpy-pos-a-string": (_numpy_with(2, "3"), "numpy_random_seed"),
    "numpy-has-gauss-2": (_numpy_with(3, 2), "numpy_random_seed"),
    "numpy-gaussian-nan": (_numpy_with(4, float("nan")), "numpy_random_seed"),
    "numpy-gaussian-an-int": (_numpy_with(4, 0), "numpy_random_seed"),
    "numpy-4-items": (lambda s: {**s, "numpy_random_seed": s["numpy_random_seed"][:4]},
                      "numpy_random_seed"),
    "numpy-a-list": (lambda s: {**s, "numpy_random_seed": list(s["numpy_random_seed"])},
                     "numpy_random_seed"),
    "python-version-2": (_python_with(version=2), "random_state"),
    "python-word-2**32": (_python_with(words=(2**32,) + _WORDS[1:]), "random_state"),
    "python-word-negative": (_python_with(words=(-1,) + _WORDS[1:]), "random_state"),
    "python-word-huge": (_python_with(words=(10**400,) + _WORDS[1:]), "random_state"),
    "python-position-625": (_python_with(words=_WORDS[:-1] + (625,)), "random_state"),
    "python-624-words": (_python_with(words=_WORDS[1:]), "random_state"),
    "python-a-float-word": (_python_with(words=(1.0,) + _WORDS[1:]), "random_state"),
    "python-gauss-a-string": (_python_with(gauss="x"), "random_state"),
    "python-2-items": (lambda s: {**s, "random_state": s["random_state"][:2]}, "random_state"),
    "python-a-list": (lambda s: {**s, "random_state": list(s["random_state"])}, "random_state"),
    "torch-int32": (_replace("torch_manual_seed", torch.zeros(1264, dtype=torch.int32)),
                    "torch_manual_seed"),
    "torch-5055-bytes": (_replace("torch_manual_seed", torch.zeros(5055, dtype=torch.uint8)),
                         "torch_manual_seed"),
    "torch-2d": (_replace("torch_manual_seed", torch.zeros(2, 2528, dtype=torch.uint8)),
                 "torch_manual_seed"),
    "torch-strided-view": (_replace("torch_manual_seed",
                                    torch.zeros(10112, dtype=torch.uint8)[::2]),
                           "torch_manual_seed"),
    "torch-view-of-a-larger-storage": (_replace("torch_manual_seed",
                                                torch.zeros(6000, dtype=torch.uint8)[:5056]),
                                       "torch_manual_seed"),
    "torch-a-list": (_replace("torch_manual_seed", [0] * 5056), "torch_manual_seed"),
    "cuda-5-bytes": (_replace("torch_cuda_manual_seed", [torch.zeros(5, dtype=torch.uint8)]),
                     "torch_cuda_manual_seed"),
    "cuda-a-string": (_replace("torch_cuda_manual_seed", "gpu"), "torch_cuda_manual_seed"),
    "step-negative": (_replace("step", -1), "step"),
    "step-a-string": (_replace("step", "3"), "step"),
    "step-a-bool": (_replace("step", True), "step"),
    "step-2**63": (_replace("step", 2**63), "step"),
    "an-unknown-key": (_replace("learning_rate", 0.1), "learning_rate"),
    "a-non-string-key": (_replace(7, 0), "7"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_malformed_field_is_one_line_naming_the_file_and_the_field(tmp_path, case):
    change, field = BAD_FIELDS[case]
    path = _save(tmp_path / "random_states_0.pkl", change(_real_state()))
    _refused(path, fsdpckpt.NotACheckpointError, f"'{field}'" if field != "7" else "7")


def test_hf_trainers_names_are_named_as_the_file_names_them(tmp_path):
    saved = {"python": random.getstate(), "numpy": ("MT19937", _KEY, 0, 0, 0.0),
             "cpu": torch.zeros(3, dtype=torch.uint8)}
    _refused(_save(tmp_path / "rng_state_0.pth", saved), fsdpckpt.NotACheckpointError,
             "field 'cpu'")


def test_a_state_given_twice_under_both_names_is_refused(tmp_path):
    state = {**_real_state(), "cpu": torch.get_rng_state()}
    _refused(_save(tmp_path / "r.pkl", state), fsdpckpt.NotACheckpointError, "'cpu'")


def test_a_value_that_is_not_a_dict_is_refused(tmp_path):
    _refused(_save(tmp_path / "r.pkl", [1, 2]), fsdpckpt.NotACheckpointError, "list")


# --- hostile pickles ----------------------------------------------------------------------------

class _RunsCommand:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_hostile_global_is_refused_in_one_line_naming_it(tmp_path):
    path = _save(tmp_path / "r.pkl", {**_real_state(), "step": _RunsCommand()})
    _refused(path, fsdpckpt.UnsafePickleError, "posix.system")


def test_a_numpy_generator_object_is_refused_as_a_global(tmp_path):
    generator = np.random.RandomState(1)
    path = _save(tmp_path / "r.pkl", {**_real_state(), "numpy_random_seed": generator})
    _refused(path, fsdpckpt.UnsafePickleError, "numpy.random")


def test_reconstruct_asked_for_anything_but_an_ndarray_is_refused(tmp_path):
    pkl = (b"\x80\x02}(" + _text("step") + b"cnumpy._core.multiarray\n_reconstruct\n"
           b"cnumpy\ndtype\nK\x00\x85" + _latin1("b") + b"\x87Ru.")
    path = tmp_path / "r.pkl"
    path.write_bytes(_archive(pkl))
    _refused(path, fsdpckpt.NotACheckpointError, "ndarray")


def test_state_set_on_an_allowlisted_global_is_refused_and_leaks_into_no_other_file(tmp_path):
    # BUILD on the ndarray stand-in itself, as a file trying to change how the next is read.
    pkl = b"\x80\x02}(" + _text("step") + b"cnumpy\nndarray\n}" + _text("x") + b"K\x01sbu."
    hostile = tmp_path / "hostile.pkl"
    hostile.write_bytes(_archive(pkl))
    # The shared unpickler refuses it first: state may only be set on what the file built.
    _refused(hostile, fsdpckpt.UnsafePickleError, "allowlisted global 'numpy.ndarray' (BUILD)")
    assert "numpy_random_seed" in load_rng_file(_save(tmp_path / "r.pkl", _real_state()))


def test_a_numpy_array_built_twice_is_refused(tmp_path):
    path = tmp_path / "r.pkl"
    path.write_bytes(_archive(
        b"\x80\x02}(" + _text("step") + b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
        b"K\x00\x85" + _latin1("b") + b"\x87R" + b"NbNbu."))
    _refused(path, fsdpckpt.NotACheckpointError, "twice")


# --- files that are not RNG files at all --------------------------------------------------------

def test_an_empty_file_is_one_line(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(b"")
    _refused(path)


def test_a_truncated_file_is_one_line(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(rng_state_bytes(1)[:5000])
    _refused(path)


def test_a_file_that_is_not_a_zip_is_one_line(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(pickle.dumps({"step": 1}))
    _refused(path)


def test_a_zip_without_a_pickle_is_one_line(tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/version", b"3\n")
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(buffer.getvalue())
    _refused(path, fsdpckpt.FsdpCkptError, "data.pkl")


def test_a_file_far_larger_than_rng_state_is_refused_before_reading(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    with open(path, "wb") as file:
        file.truncate(1 << 30)  # sparse: a gigabyte that is never read
    _refused(path, fsdpckpt.NotACheckpointError, "not an RNG state file")


def test_a_compressed_pickle_is_refused_before_it_is_inflated(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}" + b"(" * 5_000_000 + b".")
    _refused(path, fsdpckpt.NotACheckpointError, "compressed", "archive/data.pkl")


def test_an_archive_of_thousands_of_entries_is_refused(tmp_path):
    path = tmp_path / "random_states_0.pkl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        for index in range(5000):
            archive.writestr(f"archive/data/{index}", b"")
    _refused(path, fsdpckpt.NotACheckpointError, "5001 archive entries")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(fsdpckpt.CheckpointNotFoundError, match="random_states_3.pkl"):
        load_rng_file(tmp_path / "random_states_3.pkl")


# --- fuzzing --------------------------------------------------------------------------------------

_REAL_FILE = rng_state_bytes(5)


@fuzz_settings()
@given(data=damaged(_REAL_FILE, steps=4))
def test_damage_to_a_real_rng_file_raises_only_fsdpckpt_errors(tmp_path, data):
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(data)
    try:
        load_rng_file(path)
    except fsdpckpt.FsdpCkptError as exc:
        assert "\n" not in str(exc)


@fuzz_settings(0.5)
@given(cut=st.integers(0, len(_REAL_FILE) - 1))
def test_every_truncation_of_a_real_rng_file_is_one_line(tmp_path, cut):
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(_REAL_FILE[:cut])
    with pytest.raises(fsdpckpt.FsdpCkptError) as caught:
        load_rng_file(path)
    assert "\n" not in str(caught.value)
