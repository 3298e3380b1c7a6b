"""A folder of full weights given where a sharded checkpoint is wanted says what it is and
what to do, not "no checkpoint here"."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, assert_one_line_error, run_cli

HF_FOLDER = FIXTURES / "verl_fsdp2" / "merged_hf"  # config.json, model.safetensors


@pytest.mark.parametrize("verb", ["merge", "export-hf"])
def test_a_hugging_face_model_folder_is_named_as_full_weights(verb, tmp_path):
    out = tmp_path / "out"
    result = run_cli(verb, HF_FOLDER, out)
    assert_one_line_error(result, f"{HF_FOLDER}: is a Hugging Face model folder (config.json, "
                                  "model.safetensors): already full weights, not a sharded "
                                  "checkpoint; load it with from_pretrained as it is, or pass "
                                  "the sharded checkpoint it came from")
    assert "merge" not in result.stderr.replace(str(HF_FOLDER), "")  # any verb's words
    assert not out.exists()


def test_a_merged_output_folder_says_to_load_it_as_full_weights(tmp_path):
    assert run_cli("merge", FIXTURES / "fsdp2_accelerate", tmp_path / "merged", "-q").exit_code == 0
    result = run_cli("merge", tmp_path / "merged", tmp_path / "again")
    assert_one_line_error(result, "is a merged model folder (model.safetensors): already full "
                                  "weights", "load_full_state_dict")
