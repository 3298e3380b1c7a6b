"""A trainer's weight names to Hugging Face's, q/k rows reordered as its converter does.

torchtune and torchtitan train models under their own module names
(``layers.0.attn.q_proj.weight``, ``layers.0.attention.wq.weight``...); for Llama, Mistral and
Gemma (1 and 2) with rotary embeddings that pair neighbouring rows of q and k, where Hugging
Face's pair row ``i`` with row ``i + head_dim / 2``. Their converters (torchtune's
``convert_weights.tune_to_hf`` and ``gemma2_tune_to_hf``, torchtitan's
``Llama3StateDictAdapter.to_hf``) rename every key and reorder q's and k's rows within each
head: ``w.view(heads, head_dim // 2, 2, dim).transpose(1, 2)``. A plain rename would give a
model that loads clean and computes something else. torchtune's Qwen2 and torchtitan's
Qwen 3 rotate as Hugging Face does: renamed only. The families' names are in
:mod:`fsdpckpt.export._trainer_families`.

:func:`trainer_names` recognises such a checkpoint by its keys (every key must be one of the
family's names) and the config's model_type, and gives the hub name of each key and, for q
and k where the family reorders, the order of the stored rows the hub's rows are: output row
``h * head_dim + j * head_dim / 2 + k`` is stored row ``h * head_dim + 2 * k + j``. No two
neighbouring output rows are neighbouring stored rows, so the reorder is no set of row blocks
of more than one row: :func:`trainer_job` keeps the merge's copying plan and gives each
stored row of q and k its own run, written at its output row, so the weights stream as any
merge's do. The heads come from the config
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or ``hidden_size / heads``),
checked against the stored shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdpckpt.errors import ExportMismatchError
from fsdpckpt.export._moe import Piece, hub_plan
from fsdpckpt.export._trainer_families import FAMILIES, K, Q, hub_name
from fsdpckpt.merging._jobs import MergeJob
from fsdpckpt.merging._runs import Runs
from fsdpckpt.merging.plan import PlannedTensor

__all__ = ["TrainerNames", "trainer_names", "looks_like", "trainer_job"]

Shape = tuple[int, ...]

@dataclass(frozen=True)
class TrainerNames:
    """How a trainer's checkpoint is written under the hub's names.

    Attributes:
        trainer: whose names they are (``"torchtune"``, ``"torchtitan"``).
        family: which of its models' names (``"torchtune Llama"``...).
        hub: each stored name -> its hub name.
        rows: hub name -> the stored rows, in the order the hub's rows are (q and k only).
    """

    trainer: str
    family: str
    hub: dict[str, str]
    rows: dict[str, tuple[int, ...]]

    def said(self) -> str:
        """What was converted, as one phrase for the user (``ExportResult.converted``)."""
        converter = FAMILIES[self.family].converter
        return (f"{self.family} names, q/k rows reordered by heads as {converter} does"
                if self.rows else f"{self.family} names, renamed as {converter} does")

    def stored(self, hub_name: str) -> str:
        """The stored name of ``hub_name`` (itself when it is no renamed key)."""
        return next((k for k, v in self.hub.items() if v == hub_name), hub_name)


def _heads_rows(heads: int, rows: int, key: str, source: Any) -> tuple[int, ...]:
    # The converters' view(heads, head_dim // 2, 2, dim).transpose(1, 2): output row
    # (head, j, k) is stored row head * head_dim + 2 * k + j.
    head_dim = rows // heads if heads > 0 else 0
    if heads <= 0 or head_dim * heads != rows or head_dim % 2:
        raise ExportMismatchError(
            f"{key}: {rows} rows are not {heads} heads of an even head_dim, as {source} says; "
            "pass base=... with the config of the model this run trained")
    return tuple(h * head_dim + 2 * k + j for h in range(heads) for j in range(2)
                 for k in range(head_dim // 2))


def trainer_names(stored: Mapping[str, Shape], config: Mapping[str, Any],
                  source: Any) -> TrainerNames | None:
    """The hub names of a torchtune (Llama, Mistral, Gemma, Gemma 2, Qwen2) or torchtitan
    (Llama 3, Qwen 3) checkpoint's keys, and the row order of its q and k where the family's
    converter reorders them, as the trainer's own converter gives them.

    The family is the one whose names are every key and whose converter is for the config's
    ``model_type`` (:mod:`fsdpckpt.export._trainer_families`).

    Args:
        stored: the checkpoint's names and shapes, as merge names them.
        config: the base's ``config.json`` (its model_type, heads and head size).
        source: where the config was read, for messages.

    Returns:
        The :class:`TrainerNames`; None when not every key is one family's names (a
        Hugging Face checkpoint, or one this does not know), or no such family is converted
        for the config's model_type.

    Raises:
        ExportMismatchError: q's or k's rows are not the config's heads times its head size.

    Example:
        >>> trainer_names({"tok_embeddings.weight": (50, 16), ...}, config, "config.json")
    """
    for family, spec in FAMILIES.items():
        if config.get("model_type") not in spec.model_types or not stored:
            continue
        found = {key: hub_name(family, key) for key in stored}
        if any(v is None for v in found.values()):
            continue
        heads = int(config.get("num_attention_heads") or 0)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = config.get("head_dim") or (
            int(config.get("hidden_size") or 0) // heads if heads else 0)
        hub: dict[str, str] = {}
        rows: dict[str, tuple[int, ...]] = {}
        for key, (name, template) in ((k, v) for k, v in found.items() if v is not None):
            hub[key] = name
            if spec.reorder and template in (Q, K):
                count = heads if template == Q else kv_heads
                if stored[key][0] != count * head_dim:
                    raise ExportMismatchError(
                        f"{key}: {stored[key][0]} rows, but {source} says {count} heads of "
                        f"{head_dim}; pass base=... with the config of the model this run "
                        "trained")
                rows[name] = _heads_rows(count, stored[key][0], key, source)
        return TrainerNames(spec.trainer, family, hub, rows)
    return None


def looks_like(stored: Mapping[str, Shape] | set[str],
               config: Mapping[str, Any] | None = None, source: Any = None) -> str | None:
    """Which trainer's names most of ``stored`` are, when they are no family's whole set: the
    phrase for a key check's message; None when they are nobody's, or are a family's names
    converted for ``config``'s model_type (the check failed on something else). When they
    are all a family's names but ``config`` (read from ``source``) is no model they are
    converted for, says that.

    Example:
        >>> looks_like({"layers.0.attn.q_proj.weight", "layers.0.attn.lora_a.weight"})
        "these look like torchtune's names, but 1 of them ..."
    """
    kind = (config or {}).get("model_type")
    known = {f: sum(hub_name(f, k) is not None for k in stored) for f in FAMILIES}
    most = max(known.values(), default=0)
    if not stored or most * 2 < len(stored):
        return None
    fitting = [f for f in FAMILIES if known[f] == most]
    if any(kind in FAMILIES[f].model_types for f in fitting) and most == len(stored):
        return None
    best = fitting[0]
    trainer, converter = FAMILIES[best].trainer, FAMILIES[best].converter
    if most == len(stored):
        types = ", ".join(repr(t) for f in fitting for t in FAMILIES[f].model_types)
        return (f"these are {trainer}'s names ({', '.join(fitting)}), but {source} describes "
                f"a {kind!r} model; export-hf converts them for a {types} config only: pass "
                f"base=... with the config this run trained, or convert the checkpoint with "
                f"{trainer}'s own converter for its model and save the result with "
                "save_pretrained")
    odd = sorted(k for k in stored if hub_name(best, k) is None)
    return (f"these look like {trainer}'s names, but {len(odd)} of them are none of "
            f"{best}'s ({', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''}); export-hf "
            f"converts {', '.join(FAMILIES)} checkpoints only: convert this one with "
            f"{trainer}'s own converter for its model (as {converter} is for {best}) and "
            "save the result with save_pretrained")


def _planned(job: MergeJob) -> dict[str, Shape]:
    return {t.spec.name: tuple(t.spec.shape) for plan in job.plans for f in plan.files
            for t in f.tensors}


def _to_rows(runs: Runs, width: int, dest: Sequence[int]) -> Runs:
    # A chunk's runs in a 2-D tensor of rows of ``width`` elements, with stored row r written
    # as output row dest[r]: runs of at most one row each, each moved with its row.
    run, starts = runs
    if run > width:  # whole rows: one run per row (run is a multiple of width then)
        starts = [s + k for s in starts for k in range(0, run, width)]
        run = width
    return run, [dest[s // width] * width + s % width for s in starts]


def _reorder(tensor: PlannedTensor, rows: tuple[int, ...]) -> PlannedTensor:
    dest = [0] * len(rows)
    for out, stored in enumerate(rows):
        dest[stored] = out
    width = math.prod(tensor.spec.shape[1:])
    return dataclasses.replace(tensor, runs=tuple(_to_rows(r, width, dest)
                                                  for r in tensor.runs))


def trainer_job(job: MergeJob, config: Mapping[str, Any], source: Any,
                names: TrainerNames | None = None) -> tuple[MergeJob, TrainerNames | None]:
    """``job`` (the export's copying plan) with its tensors under the hub's names, when its
    keys are a trainer's (:func:`trainer_names`, or ``names`` found before), and q's and k's
    rows in the hub's order.

    Still a copying plan: each stored chunk is read once, in order, as for any merge, and
    each of its rows written where the hub's order puts it (a row is one run of the copy,
    :mod:`fsdpckpt.merging._runs`), so memory holds the copy's blocks, never a tensor.

    Returns:
        The job, renamed or as it was, and the names (None: not a trainer's).
    """
    stored = _planned(job)
    names = names or trainer_names(stored, config, source)
    if names is None:
        return job, None
    pieces = [Piece(names.hub.get(k, k), k, (0,) * len(v), v, v, True)
              for k, v in stored.items()]
    renamed = hub_plan(job, pieces, overwrite=True)  # whole pieces: renamed, still copying
    plans = tuple(dataclasses.replace(plan, files=tuple(
        dataclasses.replace(f, tensors=tuple(
            _reorder(t, names.rows[t.spec.name]) if t.spec.name in names.rows else t
            for t in f.tensors)) for f in plan.files)) for plan in renamed.plans)
    return dataclasses.replace(renamed, plans=plans), names
