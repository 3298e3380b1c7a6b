"""An MoE run exported as its users would (issue 20, section 3).

``fixtures/mixtral/`` is a real 2-rank FSDP2 run (Accelerate's ``save_state``, gloo, CPU, 3
SGD steps) of a tiny transformers 5 ``MixtralForCausalLM``; ``fixtures/generate_mixtral.py``
writes it. Its checkpoint holds transformers 5's fused experts (``mlp.experts.gate_up_proj``
``[3, 48, 16]``, 2 + 1 experts per rank); the references are transformers' own
``save_pretrained`` of the trained model (per-expert hub names and bytes) and its logits.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import fsdpckpt  # noqa: E402

from conftest import FIXTURES, assert_same_safetensors, load_clean, run_cli  # noqa: E402

MIXTRAL = FIXTURES / "mixtral"
RUN = MIXTRAL / "run"
CKPT = RUN / "checkpoint-3"
REFERENCE = MIXTRAL / "reference"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixtral") / "out"
    result = run_cli("export-hf", CKPT, out, "--json")  # base: the run folder, found
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["names_as_stored"] is None and doc["not_checked"] is None, doc
    return out


def test_the_run_holds_fused_experts_sharded_over_both_ranks():
    (model, _optimizer) = fsdpckpt.inspect_checkpoint(CKPT).parts
    fused = [t for t in model.tensors if t.name.endswith("mlp.experts.gate_up_proj")]
    assert len(fused) == 2 and all(t.shape == (3, 48, 16) for t in fused)
    assert all(len(t.chunks) == 2 for t in fused)  # 2 + 1 experts


def test_the_export_writes_the_per_expert_names_and_bytes_save_pretrained_wrote(export):
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in load_file(
        REFERENCE / "model.safetensors")
    assert_same_safetensors(export / "model.safetensors", REFERENCE / "model.safetensors")


def _logits(folder, caplog) -> torch.Tensor:
    model = load_clean(transformers.AutoModelForCausalLM, folder, caplog)
    with torch.no_grad():
        return model(input_ids=load_file(MIXTRAL / "logits.safetensors")["input_ids"]).logits


def test_the_export_loads_clean_with_save_pretraineds_logits(export, caplog):
    # Both computed here, in this process: float sums are exact only on one machine's kernels.
    torch.testing.assert_close(_logits(export, caplog), _logits(REFERENCE, caplog),
                               atol=0, rtol=0)


def test_the_exports_logits_are_the_runs_within_another_machines_rounding(export, caplog):
    # The stored logits came from the machine that trained: equal up to its kernels' rounding.
    stored = load_file(MIXTRAL / "logits.safetensors")["logits"]
    torch.testing.assert_close(_logits(export, caplog), stored, atol=1e-6, rtol=1e-4)


def test_verify_passes_on_the_runs_checkpoint():
    assert fsdpckpt.verify_checkpoint(CKPT).ok
