"""`fsdpckpt merge` / `merge-weights` / `convert` from the command line, and bad input."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys

import pytest

import fsdpckpt

from conftest import (
    DCP_FOLDERS,
    FIXTURES,
    assert_one_line_error,
    reference_state_dict,
    sigint_as_in_a_terminal,
    single_process,
)
from conftest import run_cli as run
from deep_compare import assert_same_state


def assert_untouched(output_dir, before=()):
    """Nothing half-written: the folder is absent or holds only what it held before."""
    if output_dir.exists():
        assert sorted(p.name for p in output_dir.iterdir()) == sorted(before)


# --- happy paths --------------------------------------------------------------

def test_merge_prints_a_summary_line(tmp_path):
    result = run("merge", FIXTURES / "fsdp2_accelerate", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    assert "tensors" in result.stdout
    assert str(tmp_path / "out" / "model.safetensors") in result.stdout


def test_merge_json_report(tmp_path):
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out", "--json")
    doc = json.loads(result.stdout)
    (out,) = doc["outputs"]
    assert out["files"] == [str(tmp_path / "out" / "model.safetensors")]
    assert out["tensors"] > 0 and "step" in out["objects"]


def test_merge_says_where_non_tensor_entries_went(tmp_path):
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out")
    assert "non-tensor entries" in result.stdout and "fsdpckpt.objects" in result.stdout


@pytest.mark.parametrize("flag", ["--unsafe_serialization", "--unsafe-serialization"])
def test_merge_weights_accepts_both_spellings(tmp_path, flag):
    result = run("merge-weights", DCP_FOLDERS["fsdp2-model"], tmp_path, flag)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "pytorch_model.bin").is_file()


def test_merge_weights_remove_checkpoint_dir(tmp_path):
    source = shutil.copytree(DCP_FOLDERS["fsdp2-model"], tmp_path / "pytorch_model_fsdp_0")
    result = run("merge-weights", source, tmp_path / "out", "--remove-checkpoint-dir")
    assert result.exit_code == 0 and not source.exists()
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_merge_weights_matches_accelerate(tmp_path):
    from accelerate.utils import merge_fsdp_weights as accelerate_merge
    from safetensors.torch import load_file

    folder = DCP_FOLDERS["fsdp2-model"]
    accelerate_merge(str(folder), str(tmp_path / "acc"))
    fsdpckpt.merge_fsdp_weights(str(folder), str(tmp_path / "ours"))
    theirs = load_file(tmp_path / "acc" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert list(ours) == list(theirs) or sorted(ours) == sorted(theirs)
    assert_same_state(ours, theirs)


def test_merge_weights_bin_matches_accelerate(tmp_path):
    import torch
    from accelerate.utils import merge_fsdp_weights as accelerate_merge

    folder = DCP_FOLDERS["fsdp2-model"]
    accelerate_merge(str(folder), str(tmp_path / "acc"), safe_serialization=False)
    fsdpckpt.merge_fsdp_weights(str(folder), str(tmp_path / "ours"), safe_serialization=False)
    assert_same_state(torch.load(tmp_path / "ours" / "pytorch_model.bin", weights_only=True),
                      torch.load(tmp_path / "acc" / "pytorch_model.bin", weights_only=True))


def test_same_dtype_merge_does_not_import_torch(tmp_path):
    code = ("import sys; from fsdpckpt.cli import main;"
            f"main([\"merge\", {str(DCP_FOLDERS['fsdp2-model'])!r}, {str(tmp_path / 'o')!r}, '-q'],"
            " standalone_mode=False); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_convert_round_trip_is_exact(tmp_path, dcp_folder, fmt):
    folder = dcp_folder
    (merged,) = fsdpckpt.merge(folder, tmp_path / "merged", format=fmt, max_shard_size=400)
    reference = reference_state_dict(folder)
    key = next(iter(reference)) if len(reference) == 1 else ""  # the top key merge dropped
    result = run("convert", merged.path, tmp_path / "dcp", "--key", key)
    assert result.exit_code == 0, result.output
    assert_same_state(load(tmp_path / "dcp"), reference_state_dict(folder))
    assert run("inspect", tmp_path / "dcp").exit_code == 0


def test_convert_bin_round_trip_and_dcp_can_load_it(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    folder = DCP_FOLDERS["fsdp2-optimizer"]
    fsdpckpt.merge(folder, tmp_path / "merged", format="bin")
    fsdpckpt.convert(tmp_path / "merged" / "optimizer.bin", tmp_path / "dcp", key="optimizer")
    expected = reference_state_dict(folder)
    assert_same_state(load(tmp_path / "dcp"), expected)
    target = {"optimizer": {"state": {k: {n: torch.zeros_like(v) if isinstance(v, torch.Tensor)
                                          else v for n, v in s.items()}
                                      for k, s in expected["optimizer"]["state"].items()}}}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), **single_process())
    assert_same_state(target["optimizer"]["state"], expected["optimizer"]["state"])


def load(path):
    return fsdpckpt.load_full_state_dict(path)


# --- bad input ---------------------------------------------------------------

def test_parent_with_model_and_optimizer_and_several_models_lists_folders(tmp_path):
    ckpt = shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "ckpt")
    shutil.copytree(ckpt / "pytorch_model_fsdp_0", ckpt / "pytorch_model_fsdp_1")
    result = run("merge", ckpt, tmp_path / "out")
    assert_one_line_error(result, "pytorch_model_fsdp_0", "pytorch_model_fsdp_1", "--model-index")
    assert_untouched(tmp_path / "out")


def test_merge_weights_on_a_parent_with_model_and_optimizer_names_both(tmp_path):
    result = run("merge-weights", FIXTURES / "fsdp2_accelerate", tmp_path / "out")
    assert_one_line_error(result, "pytorch_model_fsdp_0 or", "optimizer_0", "pass one of them")
    assert_untouched(tmp_path / "out")


def test_merge_weights_on_a_parent_with_only_a_model_merges_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DCP_FOLDERS["fsdp2-model"], ckpt / "pytorch_model_fsdp_0")
    assert run("merge-weights", ckpt, tmp_path / "out").exit_code == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_progress_bar_is_off_when_stderr_is_not_a_terminal_or_quiet(monkeypatch):
    from fsdpckpt import cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli._progress(False) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli._progress(True) is None
    assert callable(cli._progress(False)(100, 1))


def test_missing_shard(tmp_path, dtensor_copy):
    (dtensor_copy / "__1_0.distcp").unlink()
    result = run("merge", dtensor_copy, tmp_path / "out")
    assert_one_line_error(result, dtensor_copy / "__1_0.distcp", "missing")
    assert_untouched(tmp_path / "out")



def test_garbage_metadata(tmp_path, dtensor_copy):
    (dtensor_copy / ".metadata").write_bytes(b"\x00garbage")
    assert_one_line_error(run("merge", dtensor_copy, tmp_path / "out"), ".metadata")


def test_output_path_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    assert_one_line_error(run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out"),
                          tmp_path / "out", "is a file")


def test_existing_output_needs_overwrite(tmp_path):
    assert run("merge", DCP_FOLDERS["dtensor"], tmp_path, "-q").exit_code == 0
    assert_one_line_error(run("merge", DCP_FOLDERS["dtensor"], tmp_path), "--overwrite")
    assert run("merge", DCP_FOLDERS["dtensor"], tmp_path, "--overwrite").exit_code == 0


def test_disk_without_room_fails_before_writing(tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda _p: usage(10**6, 10**6, 100))
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out")
    assert_one_line_error(result, "only 100 are free")
    assert_untouched(tmp_path / "out")


def test_disk_filling_up_mid_merge_leaves_nothing(tmp_path, monkeypatch):
    import fsdpckpt.merging.writer as writer

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "place_tensor", full)
    (tmp_path / "out").mkdir()
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out")
    assert_one_line_error(result, "No space left on device")
    assert_untouched(tmp_path / "out")


def test_ctrl_c_mid_merge_leaves_nothing(tmp_path, monkeypatch):
    import fsdpckpt.merging.writer as writer

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "place_tensor", interrupt)
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out")
    assert_one_line_error(result, "interrupted", code=130)
    assert_untouched(tmp_path / "out")


def test_sigint_to_a_real_process_leaves_nothing_and_exits_130(tmp_path):
    # A merge slowed down inside the copy loop, interrupted for real with SIGINT.
    import signal
    import time

    code = ("import time, fsdpckpt.merging.writer as w, fsdpckpt.cli as c\n"
            "real = w.place_tensor\n"
            "def slow(*a, **k):\n    time.sleep(0.5); return real(*a, **k)\n"
            "w.place_tensor = slow\n"
            "print('started', flush=True)\n"
            f"c.main(['merge', {str(DCP_FOLDERS['dtensor'])!r}, {str(tmp_path / 'out')!r}])\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert_untouched(tmp_path / "out")


def test_convert_refuses_an_existing_folder(tmp_path):
    (tmp_path / "dcp").mkdir()
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "m")
    assert_one_line_error(run("convert", tmp_path / "m" / "model.safetensors", tmp_path / "dcp"),
                          "--overwrite")


def test_convert_missing_input(tmp_path):
    assert_one_line_error(run("convert", tmp_path / "nope.safetensors", tmp_path / "dcp"),
                          "no such file")


def test_convert_overwrite_never_deletes_a_folder_that_is_not_a_checkpoint(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "m")
    (tmp_path / "important").mkdir()
    (tmp_path / "important" / "notes.txt").write_text("precious")
    result = run("convert", tmp_path / "m" / "model.safetensors", tmp_path / "important",
                 "--overwrite")
    assert_one_line_error(result, "not a DCP folder")
    assert (tmp_path / "important" / "notes.txt").read_text() == "precious"


def test_convert_overwrite_replaces_a_dcp_folder(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "m")
    shutil.copytree(DCP_FOLDERS["fsdp2-model"], tmp_path / "dcp")
    assert run("convert", tmp_path / "m" / "model.safetensors", tmp_path / "dcp",
               "--overwrite").exit_code == 0
    assert not (tmp_path / "dcp" / "__1_0.distcp").exists()


def test_convert_to_a_file_path(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "m")
    (tmp_path / "f").write_text("x")
    assert_one_line_error(run("convert", tmp_path / "m" / "model.safetensors", tmp_path / "f",
                              "--overwrite"), "is a file")


def test_outputs_in_missing_parent_folders_are_created(tmp_path):
    assert run("merge", DCP_FOLDERS["dtensor"], tmp_path / "a" / "b" / "out", "-q").exit_code == 0
    assert (tmp_path / "a" / "b" / "out" / "model.safetensors").is_file()
    assert run("convert", tmp_path / "a" / "b" / "out" / "model.safetensors",
               tmp_path / "seed" / "pytorch_model_fsdp_0").exit_code == 0


def test_failed_merge_removes_the_parent_folders_it_created(tmp_path, dtensor_copy):
    (dtensor_copy / "__1_0.distcp").unlink()
    run("merge", dtensor_copy, tmp_path / "x" / "y" / "out")
    assert not (tmp_path / "x").exists()



def test_include_may_be_a_single_string(tmp_path):
    from safetensors import safe_open

    (result,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, include="*.bias")
    with safe_open(str(result.path), "pt") as handle:
        assert sorted(handle.keys()) == ["0.bias", "2.bias"]


def test_every_option_problem_is_reported_at_once(tmp_path):
    result = run("merge", FIXTURES / "fsdp2_accelerate", tmp_path / "o", "--max-shard-size",
                 "abc", "--model-index", "3")
    assert_one_line_error(result, "abc", "pytorch_model_fsdp_3")


def test_python_messages_name_the_keyword(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path)
    with pytest.raises(fsdpckpt.OutputExistsError, match="overwrite=True"):
        fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path)


def test_a_merge_of_another_layout_does_not_leave_the_old_one_beside_it(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path)              # model.safetensors
    with pytest.raises(fsdpckpt.OutputExistsError, match="model.safetensors"):
        fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, max_shard_size=600)
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, max_shard_size=600, overwrite=True)
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "model.safetensors.index.json").exists()
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_merge_weights_replaces_an_earlier_output_like_accelerate(tmp_path):
    folder = DCP_FOLDERS["fsdp2-model"]
    assert run("merge-weights", folder, tmp_path, "-q").exit_code == 0
    first = (tmp_path / "model.safetensors").stat().st_ino
    second = run("merge-weights", folder, tmp_path, "-q")
    assert second.exit_code == 0, second.output
    assert (tmp_path / "model.safetensors").stat().st_ino != first  # a new file, renamed in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert_same_state(load(tmp_path / "model.safetensors"),
                      next(iter(reference_state_dict(folder).values())))


def test_merge_weights_that_fails_leaves_the_earlier_output_whole(tmp_path, dtensor_copy):
    assert run("merge-weights", dtensor_copy, tmp_path / "out", "-q").exit_code == 0
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    (dtensor_copy / "__1_0.distcp").unlink()
    assert run("merge-weights", dtensor_copy, tmp_path / "out", "-q").exit_code == 1
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_merge_still_asks_for_overwrite_after_merge_weights(tmp_path):
    assert run("merge-weights", DCP_FOLDERS["dtensor"], tmp_path, "-q").exit_code == 0
    assert_one_line_error(run("merge", DCP_FOLDERS["dtensor"], tmp_path), "--overwrite")


@pytest.mark.parametrize("flags, name", [((), "optimizer.safetensors"),
                                         (("--unsafe_serialization",), "optimizer.bin")])
def test_merge_weights_names_an_optimizer_folder_for_what_it_is(tmp_path, flags, name):
    result = run("merge-weights", DCP_FOLDERS["fsdp2-optimizer"], tmp_path, "-q", *flags)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_merge_weights_overwrite_flag_is_still_accepted(tmp_path):
    assert run("merge-weights", DCP_FOLDERS["dtensor"], tmp_path, "--overwrite",
               "-q").exit_code == 0


def test_an_include_that_matches_nothing_names_a_few_tensors_that_exist(tmp_path):
    result = run("merge", FIXTURES / "fsdp2_accelerate", tmp_path / "out",
                 "--include", "layers.0.*")
    assert_one_line_error(result, "no tensor left to merge", "after --include/--exclude",
                          "its 4 tensors are named '0.weight', '0.bias', '2.weight', '2.bias'",
                          "--include '0.*'")
    assert not (tmp_path / "out").exists()
