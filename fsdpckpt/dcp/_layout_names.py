"""The names by which :mod:`fsdpckpt.dcp.layout` knows the parts of a checkpoint folder:
its DCP folders, the files saved beside them, nested checkpoints, a save's markers; and the
model files of a folder of full weights, which is none."""

from __future__ import annotations

import re

__all__ = ["DATALOADER_STATE", "INCOMPLETE", "MODEL_FILES", "VERL_HF_DIR"]

#: The model file of a folder of full weights (merged or Hugging Face), first found first: what
#: convert and ``load_full_state_dict`` read from a folder, and no part of a checkpoint.
MODEL_FILES = ("model.safetensors.index.json", "model.safetensors",
               "pytorch_model.bin.index.json", "pytorch_model.bin")

#: A dataloader's state: Accelerate's ``dl_state_dict.bin`` (``dl_state_dict_{i}.bin`` for
#: loader i), which fsdpckpt's rank 0 writes too, and the other ranks' own states
#: ``dl_state_dict[_{i}]_rank{r}.bin`` (training/_dataloader.py says why these names).
DATALOADER_STATE = re.compile(r"^dl_state_dict(?:_(?P<index>\d{1,9}))?(?:_rank(?P<rank>\d{1,9}))?"
                              r"\.bin$")

# (pattern, kind) for the files saved beside the DCP folders; the first match wins.
_SIDE_FILES = [
    # Ranks of at most 9 digits: a larger number is no rank a run had (and would make
    # every per-rank report as long as the number).
    (re.compile(r"^random_states_(\d{1,9})\.pkl$"), "rng"),
    (re.compile(r"^rng_state(_(\d{1,9}))?\.pth$"), "rng"),
    (re.compile(r"^scheduler(_\d+)?\.(bin|pt)$"), "scheduler"),
    (re.compile(r"^sampler(_\d+)?\.bin$"), "sampler"),
    (DATALOADER_STATE, "dataloader"),
    (re.compile(r"^scaler\.pt$"), "scaler"),
    (re.compile(r"^custom_checkpoint_(\d+)\.pkl$"), "custom"),
    (re.compile(r"^trainer_state\.json$"), "trainer_state"),
    (re.compile(r"^training_args\.bin$"), "training_args"),
    (re.compile(r"^fsdpckpt\.json$"), "manifest"),
    # VeRL's, beside its per-rank model and optimizer files.
    (re.compile(r"^extra_state_world_size_\d{1,9}_rank_\d{1,9}\.pt$"), "extra_state"),
    (re.compile(r"^fsdp_config\.json$"), "fsdp_config"),
]
#: The folder in which VeRL's checkpoint manager saves the model's config and tokenizer.
VERL_HF_DIR = "huggingface/"
_MODEL_DIR = re.compile(r"^pytorch_model(_fsdp)?_(\d+)$")
_OPTIMIZER_DIR = re.compile(r"^optimizer_(\d+)$")
_CHECKPOINT_DIR = re.compile(r"^(checkpoint|ckpt|step|global_step)[-_]?\d+$")
#: The intent marker of a save to object storage (training/_remote.py): written first,
#: removed once the manifest, the commit, is in. dcp/ does not import training/.
INCOMPLETE = ".fsdpckpt-incomplete"
_MANIFEST = "fsdpckpt.json"  # training.manifest.MANIFEST
