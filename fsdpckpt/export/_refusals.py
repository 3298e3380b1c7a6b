"""What export-hf refuses before it looks for a config: a source with no model in it.

export-hf exports a model's weights from a sharded checkpoint. An optimizer's folder given
alone was answered in the merge's words or the key check's (``no tensor left to merge``, a
list of missing Llama keys), and a file of weights already merged as "not a checkpoint
folder", neither saying what the path is or what to pass. Both are decided from names and
``.metadata`` alone, before anything is read or written.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.layout import CheckpointLayout, find_layout, refuse_rank_file
from fsdpckpt.dcp.parts import open_part
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import FsdpCkptError, NotACheckpointError
from fsdpckpt.merging._dtype_policy import holds_optimizer
from fsdpckpt.merging._validate import choose_parts

__all__ = ["refuse_weight_file", "refuse_optimizer"]

#: Files of full weights, as merge, convert and save_pretrained write them.
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def refuse_weight_file(where: Place) -> None:
    """Refuse a file of weights already merged (``merged/model.safetensors``, a ``.bin``, a
    shard index): export-hf exports from the sharded checkpoint it came from. A rank file is
    refused as one first (:func:`~fsdpckpt.dcp.layout.refuse_rank_file`).

    Raises:
        NotACheckpointError: one line naming the file and what to pass instead.
    """
    if not where.exists() or where.is_dir():
        return
    refuse_rank_file(where)
    if not where.name.endswith(_WEIGHT_FILES):
        return
    what = "a shard index" if where.name.endswith(".index.json") else \
        f"a {where.name.rsplit('.', 1)[-1]} file"
    raise NotACheckpointError(
        f"{where}: is weights already merged ({what}), not a sharded checkpoint; export-hf "
        "exports from the checkpoint it was merged from: pass that checkpoint folder (the "
        "one holding pytorch_model_fsdp_0/ or .metadata), and it writes these weights with "
        "config.json and the tokenizer files beside them")


def refuse_optimizer(layout: CheckpointLayout) -> list[DcpFolder]:
    """Refuse a source whose part to export is an optimizer: Accelerate's ``optimizer_0/``
    given alone (a plain DCP folder whose entries, tensors and objects, all sit under
    ``optimizer``), or a
    checkpoint holding only an optimizer.

    Returns:
        The parts' folders opened to tell (held by the caller, their ``.metadata`` is parsed
        once: the merge's own read of them below finds it parsed).

    Raises:
        NotACheckpointError: naming the folder, that it is an optimizer, and what to pass.
    """
    try:
        parts = choose_parts(layout)
    except FsdpCkptError:  # several models, an unfinished save: said by the merge's check
        return []
    opened = []
    for part in parts:
        if part.kind == "model":
            continue
        folder = open_part(part.path, part.name)
        opened.append(folder)
        # Objects too: an SGD without momentum keeps no tensor, only its param_groups.
        keys = [t.key_path for t in folder.metadata.tensors] + \
            [o.key_path for o in folder.metadata.objects]
        if part.kind == "optimizer" or holds_optimizer(keys):
            raise NotACheckpointError(_optimizer_said(part.path, keys[0] if keys else (),
                                                      layout))
    return opened


def _optimizer_said(path: Place, sample: Sequence[object], layout: CheckpointLayout) -> str:
    entry = ".".join(map(str, sample))
    head = (f"{path}: is an optimizer checkpoint (its entries are an optimizer's state, such "
            f"as {entry}), not model weights; export-hf exports a model's weights: ")
    if layout.style != "dcp":  # a checkpoint folder holding an optimizer and no model
        return head + (f"{layout.path} holds no model folder (pytorch_model_fsdp_0/); pass a "
                       "checkpoint that holds one")
    try:
        around = find_layout(path.parent)
        models = [p.path for p in around.parts if p.kind == "model"]
    except (FsdpCkptError, OSError):  # no checkpoint around it: nothing to point to
        models = []
    if models:
        return head + (f"pass the checkpoint folder {path.parent} (or its model folder "
                       f"{models[0]})")
    return head + ("pass the model's folder saved beside it (pytorch_model_fsdp_0/) or the "
                   "checkpoint folder holding both")
