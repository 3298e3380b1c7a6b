"""Which trainer family a checkpoint's names are: chosen from its keys and the base config's
model_type together, and what the key check says when they are no family's.

The real runs (torchtune 0.6.1's Gemma, Gemma 2, Mistral by
fixtures/generate_torchtune_families.py; torchtitan 0.3.0's Qwen 3 by
fixtures/generate_torchtitan_qwen3.py) are exported and compared with each framework's own
conversion and logits in tests/test_trainer_names.py; these tests take their keys.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fsdpckpt import ExportMismatchError, export_hf, load_full_state_dict
from fsdpckpt.export._trainer_names import trainer_names

from conftest import FIXTURES, single_process

QWEN3 = FIXTURES / "torchtitan_qwen3"
GEMMA2 = FIXTURES / "torchtune_gemma2"


def _shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    state = load_full_state_dict(checkpoint)
    model = state.get("model", state)  # torchtune's under "model", torchtitan's at the top
    return {k: tuple(v.shape) for k, v in model.items()}


def _config(base: Path, **changes: object) -> dict:
    return {**json.loads((base / "config.json").read_text()), **changes}


def test_the_family_is_chosen_by_the_keys_and_the_model_type() -> None:
    llama = _shapes(FIXTURES / "torchtune" / "dist_epoch_0")
    base = FIXTURES / "torchtune_hf"
    # The same names: which converter is the config's model_type's.
    for model_type, family in (("llama", "torchtune Llama"), ("mistral", "torchtune Mistral"),
                               ("gemma", "torchtune Gemma")):
        names = trainer_names(llama, _config(base, model_type=model_type), "config.json")
        assert names is not None and names.family == family and names.rows
    assert trainer_names(llama, _config(base, model_type="phi3"), "config.json") is None
    # Gemma 2's norms are no other family's names.
    gemma2 = _shapes(GEMMA2 / "dist_epoch_0")
    assert trainer_names(gemma2, _config(GEMMA2 / "hf", model_type="gemma"), "c") is None
    names = trainer_names(gemma2, _config(GEMMA2 / "hf"), "config.json")
    assert names is not None and names.family == "torchtune Gemma 2"
    assert "lm_head.weight" not in names.hub.values()  # tied: torchtune saves no output
    # Qwen 3's q/k norms: renamed, rows kept (its rotary layout is Hugging Face's).
    qwen3 = _shapes(QWEN3 / "checkpoint" / "step-2")
    assert trainer_names(qwen3, _config(QWEN3 / "hf", model_type="llama"), "c") is None
    names = trainer_names(qwen3, _config(QWEN3 / "hf"), "config.json")
    assert names is not None and names.family == "torchtitan Qwen 3" and not names.rows
    assert names.hub["layers.0.attention.q_norm.weight"] == \
        "model.layers.0.self_attn.q_norm.weight"


def test_gemma2s_feed_forward_norms_go_where_torchtunes_converter_puts_them(
        tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    export_hf(GEMMA2 / "dist_epoch_0", tmp_path / "out", base=GEMMA2 / "hf")
    got = load_file(tmp_path / "out" / "model.safetensors")
    stored = load_full_state_dict(GEMMA2 / "dist_epoch_0")["model"]
    layer = "model.layers.0."
    assert torch.equal(got[layer + "post_feedforward_layernorm.weight"],
                       stored["layers.0.mlp_norm.scale"])
    assert torch.equal(got[layer + "pre_feedforward_layernorm.weight"],
                       stored["layers.0.mlp_scale.scale"])
    assert torch.equal(got["model.norm.weight"], stored["norm.rms_norm.scale"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(("checkpoint", "base", "extra", "trainer"), [
    (QWEN3 / "checkpoint" / "step-2", QWEN3 / "hf", "layers.0.attention.sinks", "torchtitan"),
    (GEMMA2 / "dist_epoch_0", GEMMA2 / "hf", "layers.0.attn.q_norm.scale", "torchtune"),
])
def test_the_key_check_says_whose_names_they_are(tmp_path: Path, checkpoint: Path,
                                                 base: Path, extra: str,
                                                 trainer: str) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = load_full_state_dict(checkpoint)
    state = dict(state.get("model", state))
    state[extra] = torch.ones(8)  # a name no family of the trainer has
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    with pytest.raises(ExportMismatchError) as caught:
        export_hf(tmp_path / "ckpt", tmp_path / "out", base=base)
    said = str(caught.value)
    assert f"look like {trainer}'s names" in said and extra in said
    assert "pass base" not in said
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_llama_3_names_with_a_qwen3_config_are_refused_for_the_norms_they_lack(
        tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(QWEN3 / "hf", base)
    (base / "config.json").write_text(json.dumps(_config(base, tie_word_embeddings=False)))
    with pytest.raises(ExportMismatchError, match=r"missing .*self_attn\.k_norm\.weight.*"
                                                  r"pass base=\.\.\. with the config"):
        export_hf(FIXTURES / "torchtitan_llama" / "checkpoint" / "step-2", tmp_path / "out",
                  base=base)
