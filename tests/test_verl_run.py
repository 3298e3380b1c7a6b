"""Every verb on real VeRL checkpoints, checked against VeRL's own loader and merger, bit for
bit (issue 20's acceptance).

``fixtures/verl_fsdp1/`` and ``fixtures/verl_fsdp2/`` are 2-rank runs of VeRL 0.9.1's own
``FSDPCheckpointManager`` around a tiny Hugging Face Llama wrapped as VeRL's FSDP engine wraps
it (FSDP1 with ``use_orig_params`` and a device mesh named ``("fsdp",)``; FSDP2 through
VeRL's ``apply_fsdp2``), written by ``fixtures/generate_verl.py``. Beside each checkpoint:

- ``merged_hf/``: VeRL's own merger (``python -m verl.model_merger merge --backend fsdp``),
  which casts every shard to bfloat16: the reference for ``--dtype bf16`` / ``bfloat16``;
- ``reference_model.safetensors``: VeRL's own ``load_checkpoint`` into a fresh model,
  gathered: the reference in the stored dtype (float32); for FSDP2 also
  ``reference_optimizer.safetensors``, the AdamW state it loads.

FSDP1's optimizer files hold each rank's own flat-parameter state (``optimizer.state_dict()``):
inspect and verify show it as rank-local, ``merge --optimizer`` refuses it by name.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

import fsdpckpt

from conftest import FIXTURES, assert_one_line_error, run_cli
from deep_compare import assert_same_tensors

VERSIONS = {"fsdp1": FIXTURES / "verl_fsdp1", "fsdp2": FIXTURES / "verl_fsdp2"}
ACTOR = "global_step_2/actor"


@pytest.fixture(params=sorted(VERSIONS))
def run(request):
    return VERSIONS[request.param]


def _merger(run):
    """VeRL's merger's tensors (bfloat16)."""
    return load_file(run / "merged_hf" / "model.safetensors")


def _loaded(run):
    """VeRL's own loader's model (float32, as stored)."""
    return load_file(run / "reference_model.safetensors")


def test_the_references_agree_with_each_other(run):
    # The merger is VeRL's loader's model cast to bfloat16: the two references are one model.
    assert_same_tensors(_merger(run), {k: v.bfloat16() for k, v in _loaded(run).items()})


def test_inspect_shows_the_model_optimizer_and_state(run):
    ckpt = run / ACTOR
    result = run_cli("inspect", "--summary", ckpt)
    assert result.exit_code == 0, result.output
    assert "VeRL checkpoint, world size 2" in result.stdout
    assert "Not recognized" not in result.stdout
    assert "model_world_size_2_rank_*.pt  12 tensors" in result.stdout
    doc = json.loads(run_cli("inspect", "--json", ckpt).stdout)
    parts = {p["kind"]: p for p in doc["parts"]}
    assert parts["model"]["num_tensors"] == 12 and parts["model"]["world_size"] == 2
    kinds = {f.name: f.kind for f in fsdpckpt.find_layout(ckpt).side_files}
    assert kinds["huggingface/"] == "hf_config" and kinds["fsdp_config.json"] == "fsdp_config"
    if run.name == "verl_fsdp1":
        # Each rank's optimizer.state_dict() of its flat-parameter shard: shown, not merged.
        assert "rank-local state (not mergeable)" in result.stdout
        assert "rank-local optimizer state" in parts["optimizer"]["rank_local"]
        assert len(parts["optimizer"]["files"]) == 2
    else:
        assert parts["optimizer"]["num_tensors"] == 36 and "rank_local" not in parts["optimizer"]


def test_verify_reads_every_rank_file(run):
    result = run_cli("verify", run / ACTOR)
    assert result.exit_code == 0, result.output
    assert "OK" in result.stdout


def test_merge_is_verls_loaders_model_and_bf16_the_mergers(run, tmp_path):
    result = run_cli("merge", run / ACTOR, tmp_path / "fp32")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(tmp_path / "fp32" / "model.safetensors"), _loaded(run))
    result = run_cli("merge", run / ACTOR, tmp_path / "bf16", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(tmp_path / "bf16" / "model.safetensors"), _merger(run))


def test_merge_optimizer(run, tmp_path):
    result = run_cli("merge", "--optimizer", run / ACTOR, tmp_path / "out")
    if run.name == "verl_fsdp1":
        assert_one_line_error(result, "optim_world_size_2_rank_1.pt", "rank-local optimizer state",
                              "leave out --optimizer")
        assert not (tmp_path / "out").exists()
        return
    assert result.exit_code == 0, result.output
    # FSDP2's moments are DTensors: the state VeRL's load_checkpoint loads, bit for bit.
    want = load_file(run / "reference_optimizer.safetensors")
    assert len(want) == 36  # exp_avg, exp_avg_sq and step of each of the 12 parameters
    assert_same_tensors(load_file(tmp_path / "out" / "optimizer.safetensors"), want)
    result = run_cli("diff", "--optimizer", run / ACTOR, tmp_path / "out")
    assert result.exit_code == 0 and "36 bit-identical" in result.stdout, result.output


def test_export_hf_bf16_is_the_mergers_folder_and_runs_as_it(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    out = tmp_path / "hf"
    # Config and tokenizer from the checkpoint's huggingface/; no --base.
    result = run_cli("export-hf", run / ACTOR, out, "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    merged = run / "merged_hf"
    # The merger's bytes: same tensors, same header, same file.
    assert (out / "model.safetensors").read_bytes() == (merged / "model.safetensors").read_bytes()
    for name in ("config.json", "generation_config.json"):  # as the merger writes them
        assert json.loads((out / name).read_text()) == json.loads((merged / name).read_text())
    models = []
    for folder in (out, merged):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=False, output_loading_info=True)
        assert not any(info.values()), info
        models.append(model.eval())
    tokens = transformers.AutoTokenizer.from_pretrained(out)("hello world, hello model",
                                                         return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours, theirs = (m(input_ids=tokens).logits for m in models)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_export_hf_keeps_the_stored_dtype_unless_asked(run, tmp_path):
    out = tmp_path / "hf"
    result = run_cli("export-hf", run / ACTOR, out)
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(out / "model.safetensors"), _loaded(run))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert run_cli("diff", run / ACTOR, out).exit_code == 0


def test_diff_against_the_mergers_folder(run, tmp_path):
    ckpt, merged = run / ACTOR, run / "merged_hf"
    assert run_cli("export-hf", ckpt, tmp_path / "hf", "--dtype", "bfloat16").exit_code == 0
    result = run_cli("diff", tmp_path / "hf", merged)
    assert result.exit_code == 0 and "EQUAL: 12 tensors (12 bit-identical)" in result.stdout
    # The checkpoint itself is float32: equal to the merger's within bfloat16's rounding
    # (half a unit in the last place, 2**-9), bit-identical to VeRL's loader.
    result = run_cli("diff", ckpt, merged, "--rtol", "0.004")
    assert result.exit_code == 0 and "EQUAL" in result.stdout, result.output
    assert run_cli("diff", ckpt, merged).exit_code == 1  # float32 vs bfloat16, exactly
    result = run_cli("diff", ckpt, run / "reference_model.safetensors")
    assert result.exit_code == 0 and "12 bit-identical" in result.stdout, result.output


def test_load_full_state_dict_is_verls_loaders_model(run):
    state = fsdpckpt.load_full_state_dict(run / ACTOR)
    assert set(state) == {"model"}
    assert_same_tensors(state["model"], _loaded(run))
    assert_same_tensors({k: v.bfloat16() for k, v in state["model"].items()}, _merger(run))
