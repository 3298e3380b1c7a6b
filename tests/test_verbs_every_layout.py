"""One verb set over every layout (issue 20 §6): what one verb reads, the others read too,
and the spellings users type work everywhere.

Already held before this file, each with its test: ``diff`` reads VeRL folders and the
safetensors shards of torch's ``HuggingFaceStorageWriter`` (tests/test_diff_every_layout.py),
and ``load_full_state_dict`` loads a whole Accelerate checkpoint folder as merge reads it
(tests/test_load_full_layouts.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fsdpckpt
from fsdpckpt.merging.plan import parse_dtype, parse_size

from conftest import FIXTURES, ROOT, assert_one_line_error, run_cli, upload

TIED = FIXTURES / "tiny_llama" / "tied" / "checkpoint-3"
ACCELERATE = FIXTURES / "fsdp2_accelerate"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The tied tiny Llama exported by export-hf: lm_head.weight left out, as the config
    ties it."""
    out = tmp_path_factory.mktemp("export")
    result = fsdpckpt.export_hf(TIED, out)
    assert dict(result.tied) == {"lm_head.weight": "model.embed_tokens.weight"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" not in names
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """The tied checkpoint merged: lm_head.weight written, equal to the embeddings."""
    out = tmp_path_factory.mktemp("merged")
    fsdpckpt.merge(TIED, out)
    return out


# --- diff knows an export's tied keys ----------------------------------------------------

def test_diff_of_a_checkpoint_and_its_tied_export_is_equal_and_says_tied(export):
    result = run_cli("diff", TIED, export)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("tied: lm_head.weight is not in B") and
               line.endswith("model.embed_tokens.weight: equal") for line in lines), lines
    assert lines[-1].startswith("EQUAL: 21 tensors")
    assert "missing" not in result.stdout


def test_diff_json_lists_the_tie_and_compares_the_target_with_its_source(export):
    result = run_cli("diff", export, TIED, "--json")  # the export as A: unexpected otherwise
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["equal"] is True and doc["missing"] == [] and doc["unexpected"] == []
    assert doc["tied"] == [{"name": "lm_head.weight", "tied_to": "model.embed_tokens.weight",
                            "left_out_by": "a"}]
    assert doc["summary"]["tied"] == 1
    head = [t for t in doc["tensors"] if t["name"] == "lm_head.weight"]
    assert len(head) == 1 and head[0]["identical"] is True


def test_a_tied_target_that_differs_from_its_source_is_different(export, merged, tmp_path):
    state = load_file(str(merged / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][0, 0] += 1.0
    save_file(state, str(tmp_path / "untied.safetensors"))
    report = fsdpckpt.diff(tmp_path / "untied.safetensors", export)
    assert not report.equal and [t.name for t in report.tied] == ["lm_head.weight"]
    assert [t.name for t in report.differing] == ["lm_head.weight"]
    assert report.differing[0].mismatched == 1
    text = run_cli("diff", tmp_path / "untied.safetensors", export)
    assert text.exit_code == 1
    assert any(line.startswith("tied: lm_head.weight") and line.endswith("DIFFERENT")
               for line in text.stdout.splitlines()), text.stdout


def test_a_config_that_unties_the_embeddings_leaves_lm_head_missing(export, tmp_path):
    copy = shutil.copytree(export, tmp_path / "untied-config")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    report = fsdpckpt.diff(TIED, copy)
    assert not report.equal and report.missing == ("lm_head.weight",) and not report.tied


def test_a_merged_file_without_a_config_ties_nothing(export, tmp_path):
    shutil.copy(export / "model.safetensors", tmp_path / "model.safetensors")
    report = fsdpckpt.diff(TIED, tmp_path)
    assert report.missing == ("lm_head.weight",) and not report.tied


@pytest.mark.s3
def test_a_remote_tied_export_is_equal_to_its_checkpoint(s3, export):
    server, root = s3
    url = upload(server, export, f"s3://{root}/export")
    report = fsdpckpt.diff(TIED, url, storage_options=server.options)
    assert report.equal and [t.name for t in report.tied] == ["lm_head.weight"]


# --- the spellings users type ------------------------------------------------------------

@pytest.mark.parametrize("text, size", [("5G", 5 * 10**9), ("5GB", 5 * 10**9),
                                        ("5GiB", 5 * 2**30), ("5Gi", 5 * 2**30),
                                        ("500M", 500 * 10**6), ("500mb", 500 * 10**6),
                                        ("2K", 2000), ("1000", 1000), ("1T", 10**12)])
def test_parse_size_reads_the_sizes_users_type(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["bf16", "bfloat16", "BF16", "torch.bfloat16"])
def test_parse_dtype_reads_every_spelling_of_bfloat16(text):
    assert parse_dtype(text).name == "bfloat16"


@pytest.mark.parametrize("spelling", ["bfloat16", "float16", "float32", "half"])
def test_merge_takes_the_dtype_spelled_out(spelling, tmp_path):
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16"}[spelling]
    assert run_cli("merge", ACCELERATE, tmp_path / "short", "--dtype", short).exit_code == 0
    result = run_cli("merge", ACCELERATE, tmp_path / "long", "--dtype", spelling)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "long" / "model.safetensors").read_bytes() == \
        (tmp_path / "short" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("size, exact", [("1K", "1000"), ("1Ki", "1024"), ("2KiB", "2048")])
def test_merge_takes_a_shard_size_without_the_b(size, exact, tmp_path):
    assert run_cli("merge", ACCELERATE, tmp_path / "a", "--max-shard-size", size).exit_code == 0
    assert run_cli("merge", ACCELERATE, tmp_path / "b", "--max-shard-size", exact).exit_code == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(names) > 2 and names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_export_hf_takes_the_spelled_out_dtype_and_a_size_without_the_b(tmp_path):
    result = run_cli("export-hf", TIED, tmp_path / "out", "--dtype", "bfloat16",
                     "--max-shard-size", "100K", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["dtype"] == "bfloat16" and len(doc["weights"]) > 1


@pytest.mark.parametrize("command", ["merge", "export-hf"])
def test_an_unknown_dtype_is_one_line_naming_the_spellings(command, tmp_path):
    result = run_cli(command, TIED, tmp_path / "out", "--dtype", "bfloat17")
    assert_one_line_error(result, "bfloat17", "bf16 (bfloat16)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["merge", "export-hf"])
def test_an_unreadable_size_is_one_line_naming_the_forms(command, tmp_path):
    result = run_cli(command, TIED, tmp_path / "out", "--max-shard-size", "5X")
    assert_one_line_error(result, "'5X'", "5G,", "2GiB")
    assert not (tmp_path / "out").exists()


def test_a_wrong_dtype_and_a_wrong_size_are_reported_together(tmp_path):
    result = run_cli("merge", ACCELERATE, tmp_path / "out", "--dtype", "bfloat17",
                     "--max-shard-size", "5X")
    assert_one_line_error(result, "bfloat17", "'5X'")


# --- an output that names a file ---------------------------------------------------------

def test_merge_into_a_file_name_writes_that_file(tmp_path):
    result = run_cli("merge", ACCELERATE, tmp_path / "out" / "merged.safetensors")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "merged.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["merged.safetensors"]
    assert fsdpckpt.diff(ACCELERATE, tmp_path / "out" / "merged.safetensors").equal


@pytest.mark.parametrize("extra", [["--optimizer"], ["--max-shard-size", "1K"],
                                   ["--format", "bin"]])
def test_merge_into_a_file_name_it_cannot_keep_is_refused_naming_the_folder(extra, tmp_path):
    out = tmp_path / "out"
    result = run_cli("merge", ACCELERATE, out / "model.safetensors", *extra)
    assert_one_line_error(result, f"pass {out} instead")
    assert not out.exists()


@pytest.mark.parametrize("command, source", [("export-hf", TIED),
                                             ("merge-weights", ACCELERATE / "pytorch_model_fsdp_0"),
                                             ("convert", "merged")])
def test_an_output_folder_given_as_a_weight_file_is_refused_naming_the_folder(
        command, source, merged, tmp_path):
    source = merged / "model.safetensors" if source == "merged" else source
    out = tmp_path / "out"
    result = run_cli(command, source, out / "model.safetensors")
    assert_one_line_error(result, f"{out / 'model.safetensors'}: names a file",
                          f"pass {out} instead")
    assert not out.exists()


def test_an_existing_folder_with_a_weight_file_name_is_still_a_folder(tmp_path):
    out = tmp_path / "odd.safetensors"
    out.mkdir()
    assert run_cli("merge", ACCELERATE, out).exit_code == 0
    assert (out / "model.safetensors").is_file()


# --- inspect reads what diff reads --------------------------------------------------------

def test_inspect_of_a_safetensors_file_lists_its_tensors(export):
    result = run_cli("inspect", export / "model.safetensors")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].endswith(": model file, " + lines[0].rsplit(", ", 1)[1])
    assert any(line.split()[:2] == ["model.embed_tokens.weight", "float32"] for line in lines)
    assert lines[-1].startswith("Structure: OK")


def test_inspect_json_of_an_hf_folder_gives_every_tensor_and_file(export):
    result = run_cli("inspect", export, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["style"] == "model-folder" and doc["ok"] is True
    (part,) = doc["parts"]
    assert part["name"] == "model.safetensors" and part["num_tensors"] == 20
    assert [f["name"] for f in part["files"]] == ["model.safetensors"]
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        assert {t["name"] for t in part["tensors"]} == set(f.keys())


def test_inspect_of_a_sharded_export_reads_its_index(tmp_path):
    fsdpckpt.export_hf(TIED, tmp_path / "out", max_shard_size="100KB")
    doc = run_cli("inspect", tmp_path / "out" / "model.safetensors.index.json", "--json")
    assert doc.exit_code == 0, doc.output
    (part,) = json.loads(doc.stdout)["parts"]
    assert part["num_tensors"] == 20 and len(part["files"]) > 1


def test_inspect_of_a_merged_bin_folder_shows_model_and_optimizer(tmp_path):
    fsdpckpt.merge(ACCELERATE, tmp_path, optimizer=True, format="bin")
    doc = json.loads(run_cli("inspect", tmp_path, "--json").stdout)
    assert [(p["name"], p["kind"], p["num_tensors"]) for p in doc["parts"]] == \
        [("pytorch_model.bin", "model", 4), ("optimizer.bin", "optimizer", 12)]
    assert doc["parts"][1]["num_objects"] > 0


def test_inspect_of_a_cut_short_safetensors_file_is_one_line_naming_it(export, tmp_path):
    cut = tmp_path / "cut.safetensors"
    data = (export / "model.safetensors").read_bytes()
    cut.write_bytes(data[:-100])
    assert_one_line_error(run_cli("inspect", cut), str(cut), "truncated")


def test_inspect_of_a_checkpoint_folder_holding_a_model_file_inspects_the_checkpoint(tmp_path):
    ckpt = shutil.copytree(ACCELERATE, tmp_path / "ckpt")
    fsdpckpt.merge(ACCELERATE, ckpt)  # model.safetensors beside pytorch_model_fsdp_0/
    doc = json.loads(run_cli("inspect", ckpt, "--json").stdout)
    assert doc["style"] == "accelerate"


@pytest.mark.s3
def test_inspect_of_a_remote_model_folder_reads_its_headers(s3, export):
    server, root = s3
    url = upload(server, export, f"s3://{root}/inspect-export")
    report = fsdpckpt.inspect_checkpoint(url, storage_options=server.options)
    assert report.style == "model-folder" and report.ok
    assert [(p.name, p.num_tensors) for p in report.parts] == [("model.safetensors", 20)]


def test_inspect_of_a_safetensors_folder_does_not_import_torch(export):
    code = ("import sys, fsdpckpt\n"
            f"report = fsdpckpt.inspect_checkpoint({str(export)!r})\n"
            "assert report.style == 'model-folder', report.style\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("file", [FIXTURES / "dtensor" / "__0_0.distcp",
                                  ACCELERATE / "scheduler.bin",
                                  FIXTURES / "verl" / "model_world_size_2_rank_0.pt"],
                         ids=["distcp", "scheduler", "verl-rank"])
def test_inspect_of_a_file_of_a_checkpoint_says_to_pass_its_folder(file):
    assert_one_line_error(run_cli("inspect", file), str(file), "pass the folder")


def test_inspect_of_a_bin_file_lists_its_tensors(tmp_path):
    fsdpckpt.merge(ACCELERATE, tmp_path, format="bin")
    doc = json.loads(run_cli("inspect", tmp_path / "pytorch_model.bin", "--json").stdout)
    assert doc["style"] == "model-file" and doc["parts"][0]["num_tensors"] == 4
