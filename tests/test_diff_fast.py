"""diff does no work it does not need (issue 43, point 6).

Checkpoints that differ are compared without importing torch where numpy holds their dtypes
(``import torch`` took 6-26 s on a busy machine for two 4-tensor models); a checkpoint
against a Hugging Face folder of another model is not mapped to its names by building the
config's model class (27 s), and why is said after the verdict.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fsdpckpt

from chunked import split, whole, write_dcp
from conftest import FIXTURES, ROOT

# A model checkpoint against another model's Hugging Face folder (config.json beside it).
UNRELATED = (FIXTURES / "fsdp2_accelerate", FIXTURES / "tiny_llama" / "untied" /
             "trained.safetensors")


def _in_a_child(*args: str, modules: tuple[str, ...] = ("torch",)) -> tuple[list[str], dict]:
    """The CLI run in a fresh interpreter: its stdout lines, and which of ``modules`` it
    imported."""
    code = ("import json, sys\nfrom fsdpckpt.cli import main\n"
            "try:\n    main(sys.argv[1:], standalone_mode=False)\n"
            "except SystemExit:\n    pass\n"
            f"print(json.dumps({{m: m in sys.modules for m in {list(modules)!r}}}))\n")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return lines[:-1], json.loads(lines[-1])


def _special(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    flat = values.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30])
    return values.to(dtype)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two DCP folders whose tensors differ in places (NaN against a number, -0.0 against
    0.0, a changed infinity), in every dtype numpy holds, stored in several layouts."""
    root = tmp_path_factory.mktemp("diff-fast")
    a = {"f32": _special(torch.float32, (64, 48), 0), "bf16": _special(torch.bfloat16, (40, 24), 1),
         "f16": _special(torch.float16, (33,), 2), "f64": _special(torch.float64, (7, 5), 3),
         "i32": torch.arange(-50, 50, dtype=torch.int32), "u8": torch.arange(200).to(torch.uint8),
         "flags": torch.arange(10) % 3 == 0}
    b = {k: v.clone() for k, v in a.items()}
    b["f32"].view(-1)[1], b["f32"].view(-1)[2], b["f32"].view(-1)[3] = 0.0, 1.0, -math.inf
    b["f32"][10:12] += 1e-3
    b["bf16"][3] *= 1.01
    b["f16"][7:] = b["f16"][7:] * 1.001
    b["f64"][2, 3] = math.nan
    b["i32"][5] += 1
    b["u8"][0] = 255
    b["flags"][1] = True
    layouts = {"f32": split([1]), "bf16": split([0], transpose=True)}
    for folder, values in (("a", a), ("b", b)):
        write_dcp(root / folder, {k: (v, layouts.get(k, whole)) for k, v in values.items()})
    return root / "a", root / "b"


def test_checkpoints_that_differ_are_compared_without_importing_torch():
    lines, imported = _in_a_child("diff", str(FIXTURES / "fsdp1" / "pytorch_model_fsdp_0"),
                                  str(FIXTURES / "fsdp2_accelerate"))
    assert lines[-1].startswith("DIFFERENT: 4 of 4 tensors differ")
    assert imported == {"torch": False}


@pytest.mark.parametrize("tolerance", [(), ("--atol", "1e-3", "--rtol", "1e-2")])
def test_special_values_in_every_layout_get_torchs_answers_without_torch(pair, tolerance,
                                                                         monkeypatch):
    lines, imported = _in_a_child("diff", str(pair[0]), str(pair[1]), "--json", "-q",
                                  *tolerance)
    assert imported == {"torch": False}
    monkeypatch.setitem(sys.modules, "numpy", None)  # the comparison torch itself makes
    atol, rtol = (float(tolerance[1]), float(tolerance[3])) if tolerance else (0.0, 0.0)
    by_torch = fsdpckpt.diff(pair[0], pair[1], atol=atol, rtol=rtol).to_json()
    got = json.loads("\n".join(lines))
    assert got == by_torch and got["summary"]["differing"] > 0


def test_a_checkpoint_against_another_models_folder_does_not_import_transformers():
    lines, imported = _in_a_child("diff", *map(str, UNRELATED),
                                  modules=("transformers", "torch"))
    assert imported == {"transformers": False, "torch": False}, lines


def test_why_names_were_not_mapped_follows_the_verdict_in_one_short_line():
    lines, _ = _in_a_child("diff", *map(str, UNRELATED))
    verdict = next(i for i, line in enumerate(lines) if line.startswith("DIFFERENT: "))
    assert lines[verdict:][1:] == [lines[-1]] and lines[-1].startswith("names: ")
    assert len(lines[-1]) < 120 and "LlamaForCausalLM" not in lines[-1]
