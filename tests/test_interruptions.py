"""Ctrl-C and SIGTERM at the worst moments: nothing is left behind, one line is printed,
and published outputs get the mode the umask gives."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import fsdpckpt
from fsdpckpt.merging.writer import STAGING_PREFIX

from conftest import FIXTURES, assert_one_line_error, run_cli

CKPT = FIXTURES / "fsdp2_accelerate"


def _signal_right_after_mkdtemp(monkeypatch) -> None:
    """The signal lands the instant the staging folder exists, before any code after
    ``mkdtemp`` runs: the window where a merge used to leave ``OUT/.fsdpckpt-tmp-*``."""
    real = tempfile.mkdtemp

    def mkdtemp_then_signal(*args, **kwargs):
        made = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_signal)


@pytest.fixture
def signal_right_after_mkdtemp(monkeypatch, default_sigint):
    _signal_right_after_mkdtemp(monkeypatch)


def test_ctrl_c_right_after_the_staging_folder_is_made_leaves_no_output(
        tmp_path, signal_right_after_mkdtemp):
    out = tmp_path / "new" / "merged"
    with pytest.raises(KeyboardInterrupt):
        fsdpckpt.merge(CKPT, out)
    assert not (tmp_path / "new").exists()


def test_ctrl_c_right_after_staging_in_an_existing_folder_leaves_it_as_it_was(
        tmp_path, signal_right_after_mkdtemp):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        fsdpckpt.merge(CKPT, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_ctrl_c_right_after_convert_stages_leaves_nothing(tmp_path, monkeypatch, default_sigint):
    merged = tmp_path / "merged"
    fsdpckpt.merge(CKPT, merged)
    _signal_right_after_mkdtemp(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        fsdpckpt.convert(merged / "model.safetensors", tmp_path / "dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_ctrl_c_during_the_command_lines_imports_is_one_line_not_a_traceback(tmp_path):
    # Any module the command line imports raises KeyboardInterrupt, as a Ctrl-C in the
    # first second (click, tqdm, torch being imported) does.
    code = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'fsdpckpt.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['fsdpckpt', 'inspect', sys.argv[1]]\n"
        "from fsdpckpt.__main__ import run\n"
        "run()\n")
    done = subprocess.run([sys.executable, "-c", code, str(CKPT)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130
    assert done.stderr == "fsdpckpt: error: interrupted\n"


def test_the_installed_command_starts_through_the_guarded_entry_point():
    import tomllib

    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"fsdpckpt": "fsdpckpt.__main__:run"}


def test_convert_output_gets_the_mode_the_umask_gives(tmp_path):
    merged = tmp_path / "merged"
    fsdpckpt.merge(CKPT, merged)
    old = os.umask(0o022)
    try:
        fsdpckpt.convert(merged / "model.safetensors", tmp_path / "dcp")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "dcp").stat().st_mode) == 0o755
    for file in (tmp_path / "dcp").iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name


def test_a_merge_output_folder_gets_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o027)
    try:
        fsdpckpt.merge(CKPT, tmp_path / "merged")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "merged").stat().st_mode) == 0o750
    assert not any(p.name.startswith(STAGING_PREFIX) for p in (tmp_path / "merged").iterdir())


class _SetsName:
    """A class attribute whose ``__set_name__`` is where the Ctrl-C lands: Python 3.11
    raises it as ``RuntimeError: Error calling __set_name__``, caused by the interrupt (a
    Ctrl-C in ``platform``'s ``cached_property`` while an import builds a class; CI)."""

    def __set_name__(self, owner, name):
        raise KeyboardInterrupt


def _interrupted_while_a_class_is_built(*_args, **_kwargs):
    type("Built", (), {"attribute": _SetsName()})


def test_a_ctrl_c_python_wraps_while_a_class_is_built_is_an_interruption(monkeypatch):
    import fsdpckpt.inspection.inspect

    monkeypatch.setattr(fsdpckpt.inspection.inspect, "inspect_checkpoint",
                        _interrupted_while_a_class_is_built)
    result = run_cli("inspect", CKPT)
    assert_one_line_error(result, "interrupted", code=130)


def test_a_ctrl_c_python_wraps_while_the_command_line_is_imported_is_one_line():
    # Before the command's own error boundary: the import of fsdpckpt.cli in run()
    code = (
        "import sys, types\n"
        "class SetsName:\n"
        "    def __set_name__(self, owner, name):\n"
        "        raise KeyboardInterrupt\n"
        "class Cli(types.ModuleType):\n"
        "    def __getattr__(self, name):\n"
        "        type('Built', (), {'attribute': SetsName()})\n"
        "sys.modules['fsdpckpt.cli'] = Cli('fsdpckpt.cli')\n"
        "from fsdpckpt.__main__ import run\n"
        "run()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (130, "fsdpckpt: error: interrupted\n")
