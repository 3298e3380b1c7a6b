"""The command line's entry point: what it sets up for the process it runs in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The command line, its parsing replaced by a print of what a numpy import would see.
_PRINTS_OPENBLAS = (
    "import os, sys, types\n"
    "cli = types.ModuleType('fsdpckpt.cli')\n"
    "cli.main = lambda prog_name: print(os.environ.get('OPENBLAS_NUM_THREADS'))\n"
    "sys.modules['fsdpckpt.cli'] = cli\n"
    "from fsdpckpt.__main__ import run\n"
    "run()\n")


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120, env={**clean, "PYTHONPATH": str(ROOT), **env})
    return done.stdout.strip()


def test_the_command_line_keeps_openblas_to_one_thread():
    assert _run(_PRINTS_OPENBLAS) == "1"


def test_a_users_openblas_setting_wins():
    assert _run(_PRINTS_OPENBLAS, OPENBLAS_NUM_THREADS="4") == "4"


def test_the_library_leaves_its_callers_process_alone():
    code = ("import os\nimport fsdpckpt\nfrom fsdpckpt.merging import _casts\n_casts._numpy()\n"
            "print(os.environ.get('OPENBLAS_NUM_THREADS'))\n")
    assert _run(code) == "None"
