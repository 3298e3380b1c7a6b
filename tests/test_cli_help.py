"""What the command line says of itself and in its messages (issue 43, point 7): the
top-level help names every verb, the object-storage paragraph is said once, and a read-only
verb's message about damaged bytes speaks of reading, not of writing."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, damaged_copy, run_cli

#: Every command a user runs; merge-weights is accelerate's name for merge.
VERBS = ["inspect", "verify", "diff", "list", "merge", "convert", "export-hf"]


def test_the_top_level_help_names_every_verb_in_its_first_line():
    first = run_cli("--help").stdout.split("\n\n")[1].lower()  # after "Usage: ..."
    for verb in ["inspect", "verify", "diff", "merge", "convert", "export"]:
        assert verb in first, (verb, first)


def test_the_top_level_help_has_an_example_of_every_verb():
    helped = run_cli("--help").stdout
    for verb in VERBS:
        assert f"fsdpckpt {verb} " in helped, verb


@pytest.mark.parametrize("verb", VERBS + ["merge-weights"])
def test_each_verb_says_what_storage_options_are_in_a_line_or_two_and_points_to_the_rest(
        verb):
    helped = run_cli(verb, "--help").stdout
    option = helped[helped.index("--storage-options"):].split("\n  -", 1)[0]
    assert len(option.strip().splitlines()) <= 4, option
    assert "fsdpckpt --help" in option


def test_the_credentials_and_timeouts_are_told_once_at_the_top():
    helped = run_cli("--help").stdout
    assert "AWS_ENDPOINT_URL" in helped and "read_timeout" in helped


@pytest.mark.parametrize("verb", ["verify", "diff"])
def test_a_flipped_byte_seen_by_a_verb_that_writes_nothing_is_not_said_to_stop_a_write(
        tmp_path, verb):
    good = FIXTURES / "accelerate_rank_bin"
    bad = damaged_copy(good, "pytorch_model_fsdp_0_rank1.bin", tmp_path / "ckpt")
    result = run_cli(verb, bad) if verb == "verify" else run_cli("diff", good, bad)
    assert result.exit_code == 1
    said = result.output
    assert "CRC-32" in said and ("good copy" in said or "copy it again" in said)
    assert "written from it" not in said


def test_verify_names_a_damaged_rank_file_once_with_one_piece_of_advice(tmp_path):
    bad = damaged_copy(FIXTURES / "accelerate_rank_bin", "pytorch_model_fsdp_0_rank1.bin",
                       tmp_path / "ckpt")
    line = next(line for line in run_cli("verify", bad).stdout.splitlines()
                if "damaged rank file" in line)
    assert line.count("pytorch_model_fsdp_0_rank1.bin:") == 1, line
    assert "fsdpckpt verify" not in line  # verify is what is running
    assert line.count("copy") == 1 and "restore" not in line, line
