"""What a path that is no whole checkpoint is told (:mod:`fsdpckpt.dcp.layout` decides which).

Each refusal names what the path is and the path to pass instead: one file of a sharded
checkpoint (a rank file, ``.metadata``), a folder of full weights (a Hugging Face model or a
merged output), a folder of several checkpoints.
"""

from __future__ import annotations

import re

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._layout_names import MODEL_FILES
from fsdpckpt.errors import NotACheckpointError, UnfinishedSaveError

__all__ = ["STAGING", "natural_key", "rank_file_refusal", "refuse_model_folder",
           "several_checkpoints"]

#: A save's staging folder, renamed into place once complete: CheckpointManager's
#: ``.tmp-checkpoint_7``, HF Trainer's ``tmp-checkpoint-500``.
STAGING = re.compile(r"^\.?tmp-")


def rank_file_refusal(path: Place, what: str, checkpoint: Place, folder: Place,
                      fix: str = "") -> NotACheckpointError:
    """``path`` is ``what`` (``"a rank file"``, ``"the metadata file"``...) of the
    checkpoint ``checkpoint``; the verb takes ``folder`` (``fix``: other words for that)."""
    dcp = "DCP " if path.name.endswith(".distcp") or path.name == ".metadata" else ""
    shards = "one rank's shards" if what == "a rank file" else "one file of it"
    return NotACheckpointError(
        f"{path}: is {what} of the {dcp}checkpoint {checkpoint} ({shards}, not a whole "
        f"checkpoint); {fix or f'pass the folder: {folder}'}")


def refuse_model_folder(root: Place, names: list[str]) -> None:
    """Refuse a folder of full weights (``names``: its files) given where a sharded
    checkpoint is wanted: a Hugging Face model (``save_pretrained``'s ``config.json``
    beside the weights) or a merge's output.

    Raises:
        NotACheckpointError: it holds a model file; the message says how to load it.
    """
    found = next((name for name in MODEL_FILES if name in names), None)
    if found is None:
        return
    if "config.json" in names:
        raise NotACheckpointError(
            f"{root}: is a Hugging Face model folder (config.json, {found}): already full "
            "weights, not a sharded checkpoint; load it with from_pretrained as it is, or "
            "pass the sharded checkpoint it came from")
    raise NotACheckpointError(
        f"{root}: is a merged model folder ({found}): already full weights, not a sharded "
        "checkpoint; load it with fsdpckpt.load_full_state_dict, or pass the sharded "
        "checkpoint it came from")


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """Sort key that orders numbers by value: ``checkpoint-500`` before ``checkpoint-1000``."""
    return [(0, int(part)) if part.isdigit() else (1, part)
            for part in re.split(r"(\d+)", name) if part]


def several_checkpoints(root: Place, names: list[str],
                        finished: list[str]) -> NotACheckpointError:
    """The error for a folder of checkpoints (``names``; ``finished``: those whose save
    finished): list them, newest last, and suggest the newest finished one (names sort by
    their numbers, so ``checkpoint-1000`` is newer than ``checkpoint-500``)."""
    names = sorted(names, key=natural_key)
    # A save's staging folder (CheckpointManager's .tmp-checkpoint_7, HF Trainer's
    # tmp-checkpoint-500) is an unfinished save, never a checkpoint to pick.
    staged = [n for n in names if STAGING.match(n)]
    names = [n for n in names if not STAGING.match(n)]
    saves = (f"{len(staged)} unfinished save{'s' * (len(staged) != 1)} "
             f"({', '.join(staged[:3])}{', ...' if len(staged) > 3 else ''}")
    unfinished = f" and {saves}: left by saves that did not finish, not checkpoints)" \
        if staged else ""
    if not names:
        error: NotACheckpointError = UnfinishedSaveError(
            f"{root}: holds no finished checkpoint, only {saves}), left by saves that did not "
            "finish; pass a folder that holds a finished one")
    elif len(names) == 1:
        error = NotACheckpointError(f"{root}: holds one checkpoint ({names[0]}){unfinished}; "
                                    f"pass it: {root / names[0]}")
    else:
        shown = names if len(names) <= 5 else names[:2] + ["..."] + names[-2:]
        done = [n for n in names if n in finished]
        pick = done[-1] if done else names[-1]
        why = "the newest" if pick == names[-1] else \
            f"the newest finished save ({names[-1]} is not)"
        error = NotACheckpointError(
            f"{root}: holds {len(names)} checkpoints ({', '.join(shown)}){unfinished}; pass "
            f"one of them, e.g. {why}: {root / pick}")
    # Marked, so that a reader falling back to a merged output passes this message on.
    error.checkpoints = tuple(names)
    return error
