"""export-hf and LoRA fusion against the plain merge of the same checkpoint.

Run by hand (not in CI):

    python benchmarks/export.py                 # a 12-layer Llama, hidden 1024 (~800 MB fp32)
    python benchmarks/export.py --layers 24 --rounds 5

One process writes a PEFT-wrapped Llama (LoRA r=16 on q/k/v/o) as Accelerate's
save_state lays out the model (``pytorch_model_fsdp_0/`` under ``{"model": ...}``), with
its ``config.json``, tokenizer (the shipped tiny one) and ``adapter_config.json`` beside it.
Each case is a whole ``fsdpckpt`` process; cases alternate within each round; median wall
time and peak RSS (``wait4``) per case. The anchor is ``fsdpckpt merge`` of the same folder
in the same run:

  - merge: the raw weights, base and adapter tensors as stored;
  - export-hf --lora fuse: the HF folder with the adapter fused in (fp32 maths per layer);
  - export-hf --lora fuse --base: the same, the base model folder answering for the class
    (the base's weights: transformers is never imported, torch is, for the maths);
  - export-hf --lora adapter: only the adapter tensors;
  - export-hf of the plain (un-wrapped) model of the same shapes: the config beside the
    checkpoint, the model class built on the meta device to check the keys;
  - export-hf --base of the same, the base being the model folder ``save_pretrained`` wrote
    (its weights answer for the class: transformers is never imported);
  - export-hf of the plain model again, the class's answer cached by an earlier export of
    the same config (export/_expect_cache.py: transformers is never imported).

The cache is this run's own folder (``FSDPCKPT_CACHE_DIR``), never ``~/.cache``; every case but
the cached one runs with ``FSDPCKPT_NO_CACHE=1``, and the cached one is warmed once first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import run

ROOT = Path(__file__).resolve().parent.parent


def _build(work: Path, layers: int) -> None:
    # In a child: the measuring process must not hold torch (its peak would leak into the
    # children's ru_maxrss).
    code = f"""
import json, shutil, warnings
from pathlib import Path
import torch, torch.distributed.checkpoint as dcp, transformers, peft
warnings.filterwarnings("ignore")
work, tiny = Path({str(work)!r}), Path({str(ROOT / 'fixtures' / 'tiny_llama' / 'untied')!r})
config = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers={layers}, num_attention_heads=16,
                                  num_key_value_heads=16, tie_word_embeddings=False)
torch.manual_seed(0)
plain = transformers.LlamaForCausalLM(config)
# The base a user passes, saved before PEFT wraps (and changes) the same model object below.
plain.save_pretrained(str(work / "base"))
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tiny / f, work / "base" / f)
for name, model in (("plain", plain), ("lora", None)):
    folder = work / name
    if model is None:
        model = peft.get_peft_model(plain, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        model.peft_config["default"].save_pretrained(str(folder))
    dcp.save({{"model": model.state_dict()}}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
    config.save_pretrained(str(folder))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, folder / f)
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="export-hf and LoRA fusion vs merge")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _build(work, args.layers)
        os.environ["FSDPCKPT_CACHE_DIR"] = str(work / "cache")
        cli = ["env", "FSDPCKPT_NO_CACHE=1", sys.executable, "-m", "fsdpckpt"]
        cached = ["env", "FSDPCKPT_NO_CACHE=", sys.executable, "-m", "fsdpckpt", "export-hf",
                  str(work / "plain"), str(work / "out"), "-q"]
        cases = {
            "merge (anchor)": cli + ["merge", str(work / "lora"), str(work / "out"), "-q"],
            "export-hf --lora fuse": cli + ["export-hf", str(work / "lora"), str(work / "out"),
                                           "--lora", "fuse", "-q"],
            "export-hf --lora fuse --base": cli + [
                "export-hf", str(work / "lora"), str(work / "out"), "--lora", "fuse", "--base",
                str(work / "base"), "-q"],
            "export-hf --lora adapter": cli + ["export-hf", str(work / "lora"),
                                              str(work / "out"), "--lora", "adapter", "-q"],
            "export-hf (plain model)": cli + ["export-hf", str(work / "plain"),
                                             str(work / "out"), "-q"],
            "export-hf --base (weights answer)": cli + [
                "export-hf", str(work / "plain"), str(work / "out"), "--base",
                str(work / "base"), "-q"],
            "export-hf, the class's answer cached": cached,
        }
        run(cached)  # the first export of the config: keeps the class's answer
        shutil.rmtree(work / "out")
        times: dict[str, list[float]] = {k: [] for k in cases}
        peaks: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, cmd in cases.items():
                shutil.rmtree(work / "out", ignore_errors=True)
                seconds, peak = run(cmd)
                times[name].append(seconds)
                peaks[name].append(peak)
        size = sum(f.stat().st_size for f in (work / "lora").rglob("*.distcp")) / 2**20
        print(f"Llama, {args.layers} layers, hidden 1024, LoRA r=16 on q/k/v/o: {size:.0f} MiB "
              f"of shards; median of {args.rounds} rounds")
        anchor = statistics.median(times["merge (anchor)"])
        print(f"{'case':38} {'seconds':>8} {'vs merge':>9} {'peak MB':>8}")
        for name in cases:
            median = statistics.median(times[name])
            print(f"{name:38} {median:8.2f} {median / anchor:8.2f}x "
                  f"{max(peaks[name]):8.0f}")


if __name__ == "__main__":
    sys.exit(main())
