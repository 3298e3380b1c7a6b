"""export-hf of a source with no model in it says what the source is and what to pass
(issue 43, point 4): an optimizer's folder given alone was answered in the merge's words
(``no tensor left to merge``) or the key check's; a file of merged weights was "a file, not a
checkpoint folder", without a word of exporting from its checkpoint."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, assert_one_line_error, run_cli

ACCELERATE = FIXTURES / "fsdp2_accelerate"
TINY = FIXTURES / "tiny_llama" / "untied" / "checkpoint-3"


@pytest.mark.parametrize("checkpoint, extra", [
    (ACCELERATE, ()),                                          # no config.json anywhere
    (ACCELERATE, ("--base", FIXTURES / "hf_trainer_full" / "base")),
    (TINY, ()),                                                # an SGD: objects, no tensor
], ids=["accelerate", "accelerate-with-base", "tiny-llama-sgd"])
def test_an_optimizer_folder_is_refused_as_one_naming_the_checkpoint_folder(checkpoint, extra,
                                                                            tmp_path):
    out = tmp_path / "out"
    result = run_cli("export-hf", checkpoint / "optimizer_0", out, *extra)
    assert_one_line_error(result, f"{checkpoint / 'optimizer_0'}: is an optimizer checkpoint",
                          "export-hf exports a model's weights",
                          f"pass the checkpoint folder {checkpoint} (or its model folder "
                          f"{checkpoint / 'pytorch_model_fsdp_0'})")
    assert not out.exists()


@pytest.mark.parametrize("fmt, name", [("safetensors", "model.safetensors"),
                                       ("bin", "pytorch_model.bin")])
def test_a_merged_weight_file_is_refused_as_already_merged_weights(fmt, name, tmp_path):
    merged = tmp_path / "merged"
    assert run_cli("merge", ACCELERATE, merged, "--format", fmt, "-q").exit_code == 0
    out = tmp_path / "out"
    result = run_cli("export-hf", merged / name, out)
    assert_one_line_error(result, f"{merged / name}: is weights already merged (a {fmt} file)",
                          "export-hf exports from the checkpoint it was merged from: pass "
                          "that checkpoint folder")
    assert not out.exists()
