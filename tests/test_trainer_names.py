"""export-hf of a trainer's checkpoint: its names to Hugging Face's, q/k rows reordered.

The fixtures are real 2-rank checkpoints of tiny Llama 3 models and their Hugging Face side
(the base config and tokenizer, the trainer's own conversion of the model as the trainer
loads it as ``reference.safetensors``, and the logits the trainer's own model computes):
torchtune 0.6.1's (fixtures/torchtune/dist_epoch_0 and fixtures/torchtune_hf, by
fixtures/generate_torchtune_hf.py: ``tune_to_hf``) and torchtitan 0.3.0's
(fixtures/torchtitan_llama, by fixtures/generate_torchtitan_llama.py: ``to_hf``), and a
torchtune Qwen2 (fixtures/torchtune_qwen2, by fixtures/generate_torchtune_qwen2.py: renamed
by ``qwen2_tune_to_hf``, no reorder: its rotary layout is Hugging Face's). Neither
torchtune nor torchtitan is needed here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from fsdpckpt import ExportMismatchError, export_hf
from fsdpckpt.export._trainer_names import looks_like, trainer_names

from conftest import FIXTURES, single_process

TUNE = FIXTURES / "torchtune" / "dist_epoch_0"
TUNE_HF = FIXTURES / "torchtune_hf"
TITAN = FIXTURES / "torchtitan_llama"
QWEN2 = FIXTURES / "torchtune_qwen2"
RUNS = {"torchtune Llama": (TUNE, TUNE_HF),
        "torchtune Qwen2": (QWEN2 / "dist_epoch_0", QWEN2 / "hf"),
        "torchtitan Llama 3": (TITAN / "checkpoint" / "step-2", TITAN / "hf"),
        **{f"torchtune {name}": (FIXTURES / f"torchtune_{folder}" / "dist_epoch_0",
                                 FIXTURES / f"torchtune_{folder}" / "hf")
           for name, folder in (("Gemma", "gemma"), ("Gemma 2", "gemma2"),
                                ("Mistral", "mistral"))},
        "torchtitan Qwen 3": (FIXTURES / "torchtitan_qwen3" / "checkpoint" / "step-2",
                              FIXTURES / "torchtitan_qwen3" / "hf")}


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run_export(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    checkpoint, base = RUNS[request.param]
    out = tmp_path_factory.mktemp(request.param.replace(" ", "_")) / "hf"
    result = export_hf(checkpoint, out, base=base)
    assert result.converted is not None and result.converted.startswith(request.param + " ")
    return out, base, request.param


def test_a_trainers_model_exports_as_its_own_converter_bit_exact(
        run_export: tuple[Path, Path, str]) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    out, base, _ = run_export
    got = _weights(out)
    want = load_file(base / "reference.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_the_export_loads_clean_with_the_trainers_logits(
        run_export: tuple[Path, Path, str], caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    out, base, family = run_export
    with caplog.at_level(logging.WARNING, logger="transformers"):
        # eager: transformers runs Gemma 2 with no other attention
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, output_loading_info=True, trust_remote_code=False,
            attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    if family == "torchtune Gemma 2":
        # torchtune 0.6.1's Gemma 2 applies mlp_norm before the MLP, but its converter (and
        # so the export) puts it at the hub's post_feedforward_layernorm, mlp_scale at
        # pre_feedforward_layernorm: its logits are Hugging Face's with the two exchanged.
        with torch.no_grad():
            for layer in model.model.layers:
                pre, post = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
                pre.weight, post.weight = post.weight, pre.weight
    ref = load_file(base / "logits.safetensors")
    with torch.no_grad():
        logits = model(ref["tokens"]).logits.float()
    # Two implementations of the same model: equal up to float32 rounding; a plain rename
    # of q/k (rotary pairs mixed up) is off by far more.
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_rows_are_the_converters_head_reorder() -> None:
    torch = pytest.importorskip("torch")
    heads, head_dim, dim = 3, 6, 4
    stored = {"layers.0.attention.wq.weight": (heads * head_dim, dim),
              "layers.0.attention.wk.weight": (head_dim, dim), "norm.weight": (dim,)}
    config = {"model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": 1,
              "hidden_size": 12, "head_dim": head_dim}
    names = trainer_names(stored, config, "config.json")
    assert names is not None and names.trainer == "torchtitan"
    assert names.family == "torchtitan Llama 3"
    assert names.hub["norm.weight"] == "model.norm.weight"
    q = torch.arange(heads * head_dim * dim).view(heads * head_dim, dim)
    # torchtune's tune_to_hf and torchtitan's to_hf: view(n, hd // 2, 2, dim).transpose(1, 2)
    want = q.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(-1, dim)
    rows = names.rows["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q[list(rows)], want)
    assert names.rows["model.layers.0.self_attn.k_proj.weight"] == (0, 2, 4, 1, 3, 5)


def test_heads_the_config_does_not_match_are_refused(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(TUNE_HF, base)
    config = json.loads((base / "config.json").read_text())
    config["num_attention_heads"] = 4  # 16 q rows are 2 heads of 8, not 4 of 4
    config["head_dim"] = 8
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportMismatchError, match=r"layers\.0\.attn\.q_proj\.weight.*4 heads"):
        export_hf(TUNE, tmp_path / "out", base=base)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_unknown_keys_among_a_trainers_names_say_whose_names() -> None:
    stored = {"tok_embeddings.weight": (5, 4), "layers.0.attn.q_proj.weight": (4, 4),
              "layers.0.attn.q_proj.lora_a.weight": (2, 4), "norm.scale": (4,)}
    assert trainer_names(stored, {}, "config.json") is None
    said = looks_like(stored)
    assert said is not None and "torchtune's names" in said
    assert "layers.0.attn.q_proj.lora_a.weight" in said and "--base" not in said
    assert looks_like({"model.embed_tokens.weight": (5, 4)}) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_key_check_says_whose_names_a_checkpoint_has(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    state = load_file(FIXTURES / "torchtune" / "reference_model.safetensors")
    state["layers.0.attn.q_norm.scale"] = torch.ones(8)  # no torchtune Llama has it
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    with pytest.raises(ExportMismatchError) as caught:
        export_hf(tmp_path / "ckpt", tmp_path / "out", base=TUNE_HF)
    said = str(caught.value)
    assert "look like torchtune's names" in said and "layers.0.attn.q_norm.scale" in said
    assert "pass base" not in said


def test_the_reorder_streams_as_a_copy_and_casts_as_merge_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from fsdpckpt.export import _moe

    def no_cut(*args, **kwargs):  # the computed path: one whole tensor in memory
        raise AssertionError("the trainer's names took the computed path")

    monkeypatch.setattr(_moe, "_cut", no_cut)
    export_hf(TUNE, tmp_path / "out", base=TUNE_HF, dtype="bf16")
    got = _weights(tmp_path / "out")
    for key, value in load_file(TUNE_HF / "reference.safetensors").items():
        assert torch.equal(got[key], value.to(torch.bfloat16)), key


def test_a_chunk_split_by_columns_moves_each_row_part_with_its_row() -> None:
    from fsdpckpt.export._trainer_names import _to_rows

    # 4 rows of 6; a chunk of columns 3..5 of rows 2..3: runs of 3 at elements 15 and 21.
    dest = [0, 2, 1, 3]  # stored row r is output row dest[r]
    assert _to_rows((3, [15, 21]), 6, dest) == (3, [9, 21])
    # Rows 0..1 whole: one run of 12, one run per row after.
    assert _to_rows((12, [0]), 6, dest) == (6, [0, 12])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tied_llama_without_an_output_weight_exports(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    # torchtune's Llama 3.2 ties the output to the embeddings: no output.weight is saved.
    state = load_file(FIXTURES / "torchtune" / "reference_model.safetensors")
    del state["output.weight"]
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    base = tmp_path / "base"
    shutil.copytree(TUNE_HF, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    export_hf(tmp_path / "ckpt", tmp_path / "out", base=base)
    got = _weights(tmp_path / "out")
    want = load_file(TUNE_HF / "reference.safetensors")
    assert sorted(got) == sorted(k for k in want if k != "lm_head.weight")
    assert all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tied_output_weight_under_the_trainers_name_is_left_out(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    state = load_file(FIXTURES / "torchtune" / "reference_model.safetensors")
    state["output.weight"] = state["tok_embeddings.weight"].clone()
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    base = tmp_path / "base"
    shutil.copytree(TUNE_HF, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    result = export_hf(tmp_path / "ckpt", tmp_path / "out", base=base)
    assert result.tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    got = _weights(tmp_path / "out")
    assert "lm_head.weight" not in got
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                       load_file(TUNE_HF / "reference.safetensors")[
                           "model.layers.0.self_attn.q_proj.weight"])


def test_a_trainers_names_with_a_config_they_are_not_converted_for_say_so(
        tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(TUNE_HF, base)
    config = json.loads((base / "config.json").read_text())
    # torchtune's Phi-3 has its Llama's names; its converter fuses q, k, v and w1, w3.
    config.update(model_type="phi3", architectures=["Phi3ForCausalLM"], pad_token_id=0)
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportMismatchError, match=(
            r"torchtune's names \(torchtune Llama, torchtune Mistral, torchtune Gemma, "
            r"torchtune Qwen2\), but .* 'phi3' model; export-hf converts them for a 'llama', "
            r"'mistral', 'gemma', 'qwen2' config only: pass base=")):
        export_hf(TUNE, tmp_path / "out", base=base)


def test_the_command_line_says_what_it_converted(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fsdpckpt.cli import main

    result = CliRunner().invoke(main, ["export-hf", str(TUNE), str(tmp_path / "out"),
                                       "--base", str(TUNE_HF), "--json"])
    assert result.exit_code == 0, result.output
    said = json.loads(result.stdout)["converted"]
    assert said.startswith("torchtune Llama names, q/k rows reordered") and "tune_to_hf" in said
