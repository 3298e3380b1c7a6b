"""Peak memory of export-hf: the weights stream as in merge, and the tied-weight byte check
reads two bounded boxes at a time.

Each export runs in a fresh process that reports its peak RSS. Without transformers the
export needs no torch at all, so the process stays near the interpreter's own size; the
tied pair here is 2 x 64 MiB, so a check that held either tensor whole would show it.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import FIXTURES, peak_rss_mib, single_process

# Fresh processes exporting a 2 x 64 MiB tied pair, each measured.
pytestmark = pytest.mark.slow

#: The whole process without transformers: the interpreter, fsdpckpt, two 8 MiB boxes and
#: the merge's buffers; torch alone would be about 220 MB, either tensor 64 MiB.
PEAK_LIMIT_MIB = 150


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    import torch
    import torch.distributed.checkpoint as dcp

    run = tmp_path_factory.mktemp("tied")
    embed = torch.arange(8192 * 2048, dtype=torch.float32).reshape(8192, 2048)
    dcp.save({"model": {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}},
             checkpoint_id=str(run / "checkpoint-1" / "pytorch_model_fsdp_0"), **single_process())
    config = json.loads((FIXTURES / "tiny_llama" / "tied" / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (run / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny_llama" / "tied" / name, run / name)
    return run


def test_export_without_transformers_checks_tied_bytes_without_torch_in_flat_memory(
        tied_run, tmp_path):
    out = tmp_path / "out"
    code = ("import sys\nsys.modules['transformers'] = None  # not installed\n"
            "import fsdpckpt\n"
            f"r = fsdpckpt.export_hf({str(tied_run / 'checkpoint-1')!r}, {str(out)!r})\n"
            "assert r.tied == (('lm_head.weight', 'model.embed_tokens.weight'),), r.tied\n"
            "assert 'torch' not in sys.modules\n")
    peak = peak_rss_mib(code)
    assert (out / "model.safetensors").stat().st_size > 64 * 2**20
    assert peak < PEAK_LIMIT_MIB, f"export-hf peaked at {peak:.0f} MiB"
