"""A run of thousands of ranks has thousands of data files (issue 32, goal 5).

No verb holds more than a small, fixed number of them open, so each works under a
``ulimit -n`` far below the number of files; a file found closed is opened again, never
read through a descriptor number another file took over.

The checkpoint is simulated (``benchmarks/_simulate.py``: torch's own metadata classes,
``torch.save`` archives appended as DCP's writer appends them) with more rank files than
the limit each verb runs under.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt.dcp import _datafiles
from fsdpckpt.dcp._datafiles import OPEN_FILES, DataFiles

from conftest import ROOT, reference_state_dict

sys.path.insert(0, str(ROOT / "benchmarks"))
import _simulate

RANKS = 96
#: Far below the 2 x 96 data files: what Python and torch hold, and room for two folders'
#: OPEN_FILES each (diff reads two checkpoints at once).
LIMIT = 2 * OPEN_FILES + 24


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many") / "ckpt"
    return _simulate.build(root, RANKS, layers=1, hidden=192, intermediate=288, vocab=384,
                           kv=96, data=True)


def _limited(args: list[str], limit: int = LIMIT) -> subprocess.CompletedProcess[str]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=lower, cwd=ROOT)


def _cli(*args: object, limit: int = LIMIT) -> subprocess.CompletedProcess[str]:
    result = _limited(["-m", "fsdpckpt", *map(str, args)], limit)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_the_simulated_checkpoint_has_more_rank_files_than_the_limit(many):
    assert len(list((many / "pytorch_model_fsdp_0").glob("*.distcp"))) == RANKS > LIMIT


def test_inspect_runs_under_the_limit(many):
    assert "OK" in _cli("inspect", many).stdout


def test_verify_reads_every_chunk_under_the_limit(many):
    assert "OK" in _cli("verify", many).stdout


def test_merge_under_the_limit_gives_what_torch_loads(many, tmp_path):
    _cli("merge", many, tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    want = reference_state_dict(many / "pytorch_model_fsdp_0")["model"]
    assert sorted(merged) == sorted(want)
    assert all(torch.equal(merged[k], want[k]) for k in want)


def test_merge_of_the_optimizer_runs_under_the_limit(many, tmp_path):
    _cli("merge", many, tmp_path / "out", "--optimizer")
    assert (tmp_path / "out" / "optimizer.safetensors").is_file()


def test_diff_of_two_folders_runs_under_the_limit(many):
    assert "EQUAL" in _cli("diff", many, many).stdout


def test_load_full_state_dict_and_load_state_run_under_the_limit(many):
    code = f"""
import torch, fsdpckpt
sd = fsdpckpt.load_full_state_dict({str(many)!r})
model = torch.nn.Module()
model.model = torch.nn.Module()
for name, tensor in sd["model"].items():
    owner = model
    *path, last = name.split(".")
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    owner.register_parameter(last, torch.nn.Parameter(torch.zeros_like(tensor)))
fsdpckpt.load_state({str(many)!r}, model)
state = model.state_dict()
assert all(torch.equal(state[k], v) for k, v in sd["model"].items())
print("loaded", len(state))
"""
    result = _limited(["-c", code])
    assert result.returncode == 0, result.stderr
    assert "loaded 12" in result.stdout


def test_a_limit_below_what_a_verb_needs_says_how_to_raise_it(many):
    result = _limited(["-m", "fsdpckpt", "verify", str(many)], limit=12)
    assert result.returncode != 0
    assert "ulimit -n 12" in result.stderr and "raise the limit" in result.stderr
    assert "Traceback" not in result.stderr


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_data_files_keep_at_most_the_bound_open(many):
    folder = many / "pytorch_model_fsdp_0"
    before = _open_descriptors()
    with DataFiles(folder) as files:
        for rank in range(RANKS):
            files.open(f"__{rank}_0.distcp")
            assert _open_descriptors() - before <= OPEN_FILES
    assert _open_descriptors() == before


def test_a_held_reader_reads_its_own_file_after_it_was_closed(many):
    folder = many / "pytorch_model_fsdp_0"
    want = (folder / "__0_0.distcp").read_bytes()[:64]
    with DataFiles(folder) as files:
        reader = files.reader("__0_0.distcp")
        for rank in range(1, RANKS):  # closes __0_0 and gives its number to another file
            files.open(f"__{rank}_0.distcp")
        got = bytearray(64)
        reader.read_at(memoryview(got), 0)
    assert bytes(got) == want


def test_verify_opens_each_data_file_once(many, monkeypatch):
    opened: list[tuple[str, str]] = []
    real = _datafiles.open_data_file

    def counting(folder, name):
        opened.append((str(folder), name))
        return real(folder, name)

    monkeypatch.setattr(_datafiles, "open_data_file", counting)
    assert fsdpckpt.verify_checkpoint(many).ok
    assert len(opened) == len(set(opened)) == 2 * RANKS
