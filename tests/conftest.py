"""Shared test helpers: the committed fixtures and ways to damage copies of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

#: Every committed DCP folder, by a short id.
DCP_FOLDERS = {
    "fsdp2-model": FIXTURES / "fsdp2_accelerate" / "pytorch_model_fsdp_0",
    "fsdp2-optimizer": FIXTURES / "fsdp2_accelerate" / "optimizer_0",
    "fsdp1-model": FIXTURES / "fsdp1" / "pytorch_model_fsdp_0",
    "fsdp1-optimizer": FIXTURES / "fsdp1" / "optimizer_0",
    "dtensor": FIXTURES / "dtensor",
}


@pytest.fixture(params=sorted(DCP_FOLDERS), ids=sorted(DCP_FOLDERS))
def dcp_folder(request) -> Path:
    """Each committed DCP folder in turn."""
    return DCP_FOLDERS[request.param]


@pytest.fixture
def accelerate_ckpt(tmp_path) -> Path:
    """A private copy of the FSDP2 checkpoint in Accelerate's layout, free to damage."""
    return Path(shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "ckpt"))


@pytest.fixture
def dtensor_copy(tmp_path) -> Path:
    """A private copy of the DTensor DCP folder, free to damage."""
    return Path(shutil.copytree(FIXTURES / "dtensor", tmp_path / "dtensor"))
