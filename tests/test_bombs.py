"""Memory and time bombs, and the smaller leaks (issue 42): each hostile input ends in one
error within seconds and a few hundred MB, and a Ctrl-C at any moment in one line.

Inputs that took memory run in a child (``_bounded`` of ``tests/test_bounds.py``), whose
peak memory beyond its imports is bounded.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bounds import _bounded

from conftest import FIXTURES, torch_loads_fixture

#: The installed command, as a user starts it: the console script pip wrote beside python.
COMMAND = Path(sys.executable).with_name("fsdpckpt")
#: A traceback naming a file of the package: an interrupt after our code started.
PACKAGE = str(Path(__file__).resolve().parents[1] / "fsdpckpt") + os.sep


# --- a Ctrl-C at any moment of the command's start ----------------------------------------

@pytest.mark.skipif(not COMMAND.exists(), reason="the fsdpckpt command is not installed here")
def test_ctrl_c_in_the_first_300_ms_of_export_hf_is_never_a_traceback(tmp_path):
    # The console script imports the package (fsdpckpt/__init__.py) before run() and its
    # guard: an interrupt there printed a traceback. A signal that lands before Python has
    # its handler ends the process by the signal itself (-2), which prints nothing either;
    # one during Python's import of site is Python's own fatal error, before any of ours.
    seen = []
    for delay in [0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15,
                  0.2, 0.3] * 2:
        proc = subprocess.Popen([str(COMMAND), "export-hf", str(FIXTURES / "fsdp2_accelerate"),
                                 str(tmp_path / "out")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        seen.append((delay, proc.returncode, err))
    for delay, code, err in seen:
        if err.startswith("Fatal Python error: init_") or (  # init_import_site, _sys_streams
                err.startswith(("Traceback", "Exception ignored in: <function _get_module_lock"))
                and (PACKAGE not in err or _before_the_handler(err))):
            # Python's own start (its standard streams, site, .pth files, finding the
            # package on sys.path, the import lock of the package itself, whose callback
            # Python reports and ignores, the few bytecodes of __init__.py in front of the
            # handler): no code of ours that could take the signal has run yet, nor can it
            continue
        assert "Traceback" not in err, (delay, err)
        assert code in (130, -signal.SIGINT, 1), (delay, code, err)
        assert len(err.strip().splitlines()) <= 1, (delay, err)
        if code == 130:
            assert err == "fsdpckpt: error: interrupted\n"
    assert not (tmp_path / "out").exists()


def _before_the_handler(err: str) -> bool:
    """Whether a traceback's innermost frame is a line of ``fsdpckpt/__init__.py`` in front
    of the one that installs its SIGINT handler: a signal Python took before any Python code
    can take it, as in site's start."""
    init = PACKAGE + "__init__.py"
    lines = (Path(init).read_text().splitlines())
    handler = next(n for n, line in enumerate(lines, 1) if "_signal.signal(" in line)
    frames = re.findall(r'File "([^"]+)", line (\d+)', err)
    return bool(frames) and frames[-1][0] == init and int(frames[-1][1]) <= handler


# --- torch's _get_layout stand-in: only a layout's name ------------------------------------

class _LayoutOf:
    """Pickles as ``torch.serialization._get_layout(value)``, as torch pickles a layout."""

    def __init__(self, value) -> None:
        self.value = value

    def __reduce__(self):
        import torch.serialization

        return (torch.serialization._get_layout, (self.value,))


def _text_bomb():
    # A few KB of pickle (every level memoized) whose str() is about 600 MB.
    line = "x" * 1000
    rows = [line] * 100
    block = [rows] * 100
    return [block] * 60


def _refused_in_child(call: str, path: Path, error: str, tmp_path: Path) -> str:
    """``fsdpckpt.<call>(path)`` in a bounded child: it must raise ``fsdpckpt.<error>``
    within 5 s; returns the error's message."""
    out = _bounded(f"""
        import time
        start = time.monotonic()
        try:
            fsdpckpt.{call}({str(path)!r})
        except fsdpckpt.{error} as exc:
            print("REFUSED", exc)
        print("SECONDS", time.monotonic() - start)
    """, tmp_path)
    assert "REFUSED" in out, out
    assert float(out.split("SECONDS")[1].split()[0]) < 5, out
    return out.split("REFUSED", 1)[1].rsplit("SECONDS", 1)[0].strip()


def _assert_layout_refused_briefly(ckpt: Path, tmp_path: Path, error: str) -> None:
    """``inspect_checkpoint(ckpt)``, in a bounded child, raises ``error`` naming the layout
    in under 1,000 characters and 5 s."""
    message = _refused_in_child("inspect_checkpoint", ckpt, error, tmp_path)
    assert "layout" in message and len(message) < 1000, message[:2000]


def test_a_layout_whose_text_is_huge_is_refused_in_a_metadata(dtensor_copy, tmp_path):
    meta = pickle.loads((dtensor_copy / ".metadata").read_bytes())  # our fixture: trusted
    meta.version = _LayoutOf(_text_bomb())
    data = pickle.dumps(meta)
    assert len(data) < 20_000
    (dtensor_copy / ".metadata").write_bytes(data)
    _assert_layout_refused_briefly(dtensor_copy, tmp_path, "NotACheckpointError")


def test_a_layout_whose_text_is_huge_is_refused_in_a_rank_file(tmp_path):
    import torch

    ckpt = Path(shutil.copytree(FIXTURES / "accelerate_rank_bin", tmp_path / "ckpt"))
    rank0 = ckpt / "pytorch_model_fsdp_0_rank0.bin"
    import torch.distributed.tensor  # DTensors load only once it is imported

    state = torch_loads_fixture(rank0)  # skips where this torch cannot read the fixture
    state[next(iter(state))] = _LayoutOf(_text_bomb())
    torch.save(state, rank0)
    _assert_layout_refused_briefly(ckpt, tmp_path, "FsdpCkptError")


# --- chunks: no more than the .metadata's bytes can describe -------------------------------

def test_a_metadata_listing_one_chunk_two_million_times_is_refused_before_building(
        dtensor_copy, tmp_path):
    # Memoized, each copy is a 2-byte reference: 4 MB stood for 2 million chunks, built
    # (1.1 GB, 11 s) and then checked for overlaps.
    meta = pickle.loads((dtensor_copy / ".metadata").read_bytes())  # our fixture: trusted
    entry = next(iter(meta.state_dict_metadata.values()))
    entry.chunks = [entry.chunks[0]] * 2_000_000
    (dtensor_copy / ".metadata").write_bytes(pickle.dumps(meta))
    message = _refused_in_child("inspect_checkpoint", dtensor_copy, "NotACheckpointError", tmp_path)
    assert "2000000 chunks" in message, message


# --- files read whole: bounded by the bytes on disk, not their apparent size ---------------

def test_a_sparse_metadata_beside_sparse_data_files_is_refused_unread(dtensor_copy, tmp_path):
    # The bound by the data files' sizes let it through: they were made 10 GB too.
    os.truncate(dtensor_copy / "__0_0.distcp", 10 * 2**30)
    os.truncate(dtensor_copy / ".metadata", 2**30)
    message = _refused_in_child("inspect_checkpoint", dtensor_copy, "NotACheckpointError", tmp_path)
    assert "sparse" in message, message


def test_verify_refuses_a_sparse_manifest_unread(tmp_path):
    from conftest import save_small_checkpoint

    ckpt = save_small_checkpoint(tmp_path / "ckpt")
    os.truncate(ckpt / "fsdpckpt.json", 2**30)
    message = _refused_in_child("verify_checkpoint", ckpt, "CorruptCheckpointError", tmp_path)
    assert "sparse" in message, message


# --- torch's loader: our error, in our words ----------------------------------------------

class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_load_full_state_dict_of_a_hostile_bin_is_our_refusal_not_torchs_advice(tmp_path):
    import torch

    import fsdpckpt

    hostile = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(2), "extra": _RunsCode()}, hostile)
    with pytest.raises(fsdpckpt.UnsafePickleError) as caught:
        fsdpckpt.load_full_state_dict(hostile)
    message = str(caught.value)
    assert str(hostile) in message and "posix.system" in message
    assert "weights_only" not in message and len(message) < 500


def test_load_full_state_dict_of_a_bin_that_is_no_archive_is_not_a_checkpoint(tmp_path):
    import fsdpckpt

    garbage = tmp_path / "pytorch_model.bin"
    garbage.write_bytes(b"\x80\x02}q\x00." + b"\x00" * 100)  # a legacy pickle, cut
    with pytest.raises(fsdpckpt.NotACheckpointError) as caught:
        fsdpckpt.load_full_state_dict(garbage)
    assert str(garbage) in str(caught.value) and "weights_only" not in str(caught.value)


# --- messages quote a file's names and numbers only so far ---------------------------------

def test_problems_quote_a_megabyte_tensor_name_and_a_thousand_dims_only_briefly(dtensor_copy):
    from fsdpckpt.dcp.checks import check_folder
    from fsdpckpt.dcp.reader import read_dcp_folder

    meta = pickle.loads((dtensor_copy / ".metadata").read_bytes())  # our fixture: trusted
    fqn, entry = next(iter(meta.state_dict_metadata.items()))
    long_name = "w" * 1_000_000
    meta.state_dict_metadata[long_name] = meta.state_dict_metadata.pop(fqn)
    for index in [k for k in meta.storage_data if k.fqn == fqn]:
        moved = dataclasses.replace(index, fqn=long_name)
        meta.storage_data[moved] = meta.storage_data.pop(index)
    meta.planner_data.pop(fqn, None)
    size = type(entry.chunks[0].offsets)
    entry.chunks[0].offsets, entry.chunks[0].sizes = size([0] * 1000), size([1] * 1000)
    (dtensor_copy / ".metadata").write_bytes(pickle.dumps(meta))
    problems = check_folder(read_dcp_folder(dtensor_copy))
    assert problems and all(len(p.message) < 600 for p in problems), \
        [len(p.message) for p in problems]
