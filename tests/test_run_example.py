"""The whole life of a run, as docs/training.md shows it (docs/run_example.py): Hugging Face
weights in, training with checkpoints, a resume, a Hugging Face folder out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import workers
from conftest import FIXTURES, ROOT
from multirank import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchdata")


def _example():
    spec = importlib.util.spec_from_file_location("run_example", ROOT / "docs" / "run_example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _pretrained(folder: Path) -> str:
    config = transformers.LlamaConfig.from_pretrained(FIXTURES / "tiny_llama" / "tied")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(FIXTURES / "tiny_llama" / "tied").save_pretrained(
        folder)
    return str(folder)


def test_the_run_starts_from_the_pretrained_weights(tmp_path):
    pretrained = _pretrained(tmp_path / "pretrained")
    losses = _example().main(pretrained, str(tmp_path / "run"), str(tmp_path / "final"),
                             total_steps=1)
    # The first step's loss is the pretrained model's on the loader's first batch.
    reference = transformers.LlamaForCausalLM.from_pretrained(pretrained)
    batch = next(iter(_example().data(reference.config.vocab_size, rank=0)))
    with torch.no_grad():
        assert reference(input_ids=batch, labels=batch).loss.item() == losses[0]


def test_a_resumed_run_trains_and_ends_exactly_as_an_uninterrupted_one(tmp_path):
    example, pretrained = _example(), _pretrained(tmp_path / "pretrained")
    straight = example.main(pretrained, str(tmp_path / "a"), str(tmp_path / "a-final"))
    example.main(pretrained, str(tmp_path / "b"), str(tmp_path / "b-final"), total_steps=4)
    torch.manual_seed(123)  # the resume restores the loader's position, not the global seed
    resumed = example.main(pretrained, str(tmp_path / "b"), str(tmp_path / "b-final"))
    assert resumed == straight[4:]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a-final" / name).read_bytes() == \
            (tmp_path / "b-final" / name).read_bytes()


def test_the_final_model_loads_with_from_pretrained_and_gives_the_trained_logits(tmp_path):
    example, pretrained = _example(), _pretrained(tmp_path / "pretrained")
    example.main(pretrained, str(tmp_path / "run"), str(tmp_path / "final"))
    tuned, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final",
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    trained = example.build(pretrained)  # the last checkpoint's model, as the run left it
    import fsdpckpt

    fsdpckpt.load_state(tmp_path / "run" / "checkpoint_5", trained)
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(tuned(input_ids=ids).logits, trained(input_ids=ids).logits)


@pytest.mark.multirank
def test_the_run_on_two_ranks_resumes_exactly_and_ends_in_a_loadable_model(tmp_path):
    pretrained = _pretrained(tmp_path / "pretrained")
    straight = run_ranks(workers.run_example, str(ROOT), pretrained, str(tmp_path / "a"), 6)
    run_ranks(workers.run_example, str(ROOT), pretrained, str(tmp_path / "b"), 4)
    resumed = run_ranks(workers.run_example, str(ROOT), pretrained, str(tmp_path / "b"), 6)
    assert [r[4:] for r in straight] == resumed
    assert (tmp_path / "a-final" / "model.safetensors").read_bytes() == \
        (tmp_path / "b-final" / "model.safetensors").read_bytes()
    tuned, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a-final",
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
