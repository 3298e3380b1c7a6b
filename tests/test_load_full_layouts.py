"""load_full_state_dict opens a checkpoint as merge does: every layout merge reads loads."""

from __future__ import annotations

import shutil

import pytest

import fsdpckpt

from conftest import FIXTURES
from deep_compare import assert_same_state

WHOLE = FIXTURES / "fsdp2_accelerate"


def test_a_whole_accelerate_checkpoint_loads_its_model_folder():
    assert_same_state(fsdpckpt.load_full_state_dict(WHOLE),
                      fsdpckpt.load_full_state_dict(WHOLE / "pytorch_model_fsdp_0"))


def test_a_checkpoint_of_two_models_is_refused_naming_both(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(WHOLE, copy)
    shutil.copytree(copy / "pytorch_model_fsdp_0", copy / "pytorch_model_fsdp_1")
    with pytest.raises(fsdpckpt.errors.NotACheckpointError, match="2 models") as caught:
        fsdpckpt.load_full_state_dict(copy)
    assert "pytorch_model_fsdp_0" in str(caught.value)
    assert "pytorch_model_fsdp_1" in str(caught.value)
    assert "--model-index" not in str(caught.value)  # merge's flag: this function has none
