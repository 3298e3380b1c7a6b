"""A rank file given where a checkpoint or a full file is wanted: every verb says it is one
rank's shards and names the folder to pass (docs/cli.md), before reading it."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, assert_one_line_error, run_cli, run_fresh

CKPT = FIXTURES / "fsdp2_accelerate"
RANK_FILE = CKPT / "pytorch_model_fsdp_0" / "__0_0.distcp"
DCP = CKPT / "pytorch_model_fsdp_0"

#: (verb's arguments, with OUT for an output path; the folder it is told to pass)
VERBS = {
    "inspect": (["inspect", RANK_FILE], CKPT),
    "verify": (["verify", RANK_FILE], CKPT),
    "merge": (["merge", RANK_FILE, "OUT"], CKPT),
    "merge-weights": (["merge-weights", RANK_FILE, "OUT"], DCP),
    "export-hf": (["export-hf", RANK_FILE, "OUT"], CKPT),
    "convert": (["convert", RANK_FILE, "OUT"], CKPT),
    "diff-right": (["diff", CKPT, RANK_FILE], CKPT),
    "diff-left": (["diff", RANK_FILE, CKPT], CKPT),
}


def _args(verb: str, out) -> list[str]:
    return [str(out) if a == "OUT" else str(a) for a in VERBS[verb][0]]


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_rank_file_is_refused_naming_the_folder_to_pass(verb, tmp_path):
    out = tmp_path / "out"
    result = run_cli(*_args(verb, out))
    assert_one_line_error(result, f"{RANK_FILE}: is a rank file of the DCP checkpoint {DCP} "
                                  "(one rank's shards, not a whole checkpoint)",
                          str(VERBS[verb][1]))
    assert "damaged" not in result.stderr and not out.exists()


def test_convert_of_a_rank_file_says_to_merge_its_checkpoint(tmp_path):
    result = run_cli("convert", RANK_FILE, tmp_path / "out")
    assert_one_line_error(result, f"fsdpckpt merge {CKPT} OUT_DIR")


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_rank_file_is_refused_without_importing_torch(verb, tmp_path):
    run_fresh("import sys\n"
              "from click.testing import CliRunner\n"
              "from fsdpckpt.cli import main\n"
              f"result = CliRunner().invoke(main, {_args(verb, tmp_path / 'out')!r})\n"
              "assert result.exit_code == 1 and 'is a rank file' in result.output, "
              "result.output\n"
              "assert 'torch' not in sys.modules, 'torch was imported'")


def test_the_metadata_file_is_refused_naming_its_checkpoint():
    result = run_cli("inspect", DCP / ".metadata")
    assert_one_line_error(result, f"{DCP / '.metadata'}: is the metadata file of the DCP "
                                  f"checkpoint {DCP}", f"pass the folder: {CKPT}")


def test_a_per_rank_torch_save_file_is_refused_as_a_rank_file(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model_world_size_2_rank_0.pt").write_bytes(b"PK\x03\x04 not read")
    result = run_cli("merge", folder / "model_world_size_2_rank_0.pt", tmp_path / "out")
    assert_one_line_error(result, "is a rank file of the checkpoint", f"pass the folder: {folder}")


@pytest.mark.parametrize("load", ["load_full_state_dict", "load_state"])
def test_the_loaders_refuse_a_rank_file_naming_the_folder(load):
    import fsdpckpt
    from fsdpckpt.errors import NotACheckpointError

    with pytest.raises(NotACheckpointError, match="is a rank file of the DCP checkpoint") as err:
        getattr(fsdpckpt, load)(str(RANK_FILE))
    assert str(err.value).endswith(f"pass the folder: {CKPT}")
