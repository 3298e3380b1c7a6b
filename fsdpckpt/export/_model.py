"""What the config's model class expects: its keys and shapes, and which keys are tied.

With ``transformers`` installed (the ``hf`` extra), the class named by the config is built
on the meta device (no memory, no weights) and asked; a class that needs custom code
(``auto_map``) only with ``trust_remote_code``, which every transformers call is given
explicitly, so transformers never runs code or asks on stdin unbidden. Without it, only the
config is read, and tied embeddings follow ``tie_word_embeddings`` alone. Tied keys are
decided by the model built from the config, never by storage identity in the checkpoint:
FSDP gathers each name's own copy, so a checkpoint's tied tensors are never one storage.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.storage import Place
from fsdpckpt.export._config import CONFIG, strip_fsdp_prefix
from fsdpckpt.export._keycheck import base_weights, custom_code, custom_code_reason
from fsdpckpt.export._moe import Piece, saved_layout

__all__ = ["ModelExpectation", "expect_model", "tied_without_transformers", "start_import",
           "BaseWeights", "base_may_answer", "expect_from_base"]

#: The output-embedding key most causal LMs tie to their input embeddings.
_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ModelExpectation:
    """What the model class built from the config holds.

    Attributes:
        model_class: its name (``LlamaForCausalLM``).
        shapes: every key of its state dict (tied targets included) and its shape.
        tied: tied target -> the key it is tied to (``{"lm_head.weight":
            "model.embed_tokens.weight"}``); targets are not written.
        saved: what ``save_pretrained`` writes for each key (the hub's names, fused MoE
            experts cut per expert: :func:`~fsdpckpt.export._moe.saved_layout`); or why
            that is not known, and the keys are written as they are named in memory.
    """

    model_class: str
    shapes: dict[str, tuple[int, ...]]
    tied: dict[str, str]
    saved: dict[str, tuple[Piece, ...]] | str = ""


#: The base's weights, by name with their shapes, and the file that lists them.
BaseWeights = tuple[dict[str, tuple[int, ...]], Place]


def base_may_answer(config_file: Place, base: Place | None) -> BaseWeights | None:
    """The base's weights when they may stand in for the model class: the config exported is
    the base's own (``base/config.json``) and its safetensors weights give every name and
    shape; else None. (A config naming custom code is left to the class by
    :func:`expect_from_base`.)

    A base folder written by ``save_pretrained`` holds exactly the names and shapes the
    class built from its config writes (tied targets left out), so when a checkpoint's names
    and shapes are those, nothing is left for the class to say, and neither transformers nor
    the model's code is imported (seconds of an export's time, most of a small one's).
    """
    if base is None or str(storage.resolved(config_file)) != str(storage.resolved(base / CONFIG)):
        return None
    weights = base_weights(base)
    if weights is None:
        return None
    shapes = {name: tuple(shape) for name, shape in weights[0].items() if shape is not None}
    # Names alone (a .bin base, an index without its files): the class decides.
    return (shapes, weights[1]) if len(shapes) == len(weights[0]) else None


def expect_from_base(shapes: dict[str, tuple[int, ...]], config: dict[str, Any],
                     weights: BaseWeights) -> ModelExpectation | None:
    """The model class's expectation, answered by the base's weights (:func:`base_may_answer`)
    when the checkpoint's names and shapes are exactly theirs, ties from the config as
    without transformers (:func:`tied_without_transformers`); None when they are not (other
    names: MoE experts fused in memory, LLaVA's, another tie), and the class must be built.

    Args:
        shapes: the exported tensors' names and shapes (tied targets included).
        config: the exported config.
        weights: the base's weights.
    """
    if custom_code(config):
        return None
    tied = tied_without_transformers(config, shapes)
    wanted, _where = weights
    if set(wanted) != set(shapes) - set(tied) or any(
            wanted[name] != tuple(shape) for name, shape in shapes.items() if name in wanted):
        return None
    if any(tuple(shapes[target]) != tuple(shapes[source]) for target, source in tied.items()):
        return None
    names = [strip_fsdp_prefix(a) for a in (config.get("architectures") or [])
             if isinstance(a, str)]
    model_class = names[0] if names else str(config.get("model_type"))
    return ModelExpectation(model_class, {n: tuple(v) for n, v in shapes.items()}, tied, "")


def start_import(config: dict[str, Any]) -> threading.Thread:
    """Start importing torch, transformers and the config's model class in the background.

    Importing them is most of an export's time (seconds, against well under one for
    planning and the tied-weight check of a small model), and nothing else in the export
    needs them: started first, the import runs while the main thread finds, plans and
    checks, and :func:`expect_model` finds the modules loaded. Any failure is left for
    :func:`expect_model` to meet again in the caller's thread.

    Returns:
        The (daemon) thread; join it before :func:`expect_model` for the full benefit.
    """
    names = [strip_fsdp_prefix(a) for a in (config.get("architectures") or [])
             if isinstance(a, str)]

    def load() -> None:
        try:
            import transformers

            for name in names:  # transformers is lazy: this imports the class's module only
                if hasattr(transformers, name):
                    break
        except Exception:  # noqa: BLE001  expect_model meets it again, and reports it
            pass

    thread = threading.Thread(target=load, name="fsdpckpt-import-transformers", daemon=True)
    thread.start()
    return thread


def expect_model(config_dir: Path, config: dict[str, Any], *,
                 trust_remote_code: bool = False) -> ModelExpectation | str:
    """Build the config's model class on the meta device and read what it expects.

    Custom code (an ``auto_map``, :func:`~fsdpckpt.export._keycheck.custom_code`) is never
    handed to transformers unless ``trust_remote_code``: transformers would run it, or ask
    on stdin whether to. Every transformers call is given ``trust_remote_code`` explicitly,
    so it never asks.

    Args:
        config_dir: a folder holding the exported ``config.json`` (and, for custom code,
            the code files it names).
        config: that config, as read.
        trust_remote_code: build a custom-code model by running its code.

    Returns:
        The expectation; or why the class was not built (one phrase for the user): custom
        code not trusted, transformers not installed, a model type or architecture it
        does not know.
    """
    refs = custom_code(config)
    if refs and not trust_remote_code:
        return custom_code_reason(refs)
    missing = "transformers is not installed: pip install 'fsdpckpt[hf]'"
    try:  # transformers first: without it, torch (about 220 MB) is never imported
        import transformers
    except ImportError:
        return missing
    try:
        import torch
    except ImportError:
        return missing
    model_type = config.get("model_type")
    if not refs and model_type not in transformers.CONFIG_MAPPING:
        return (f"model_type {str(model_type)[:80]!r} is not one transformers "
                f"{transformers.__version__} knows")
    # transformers logs and warns about things that are the export's business, not the
    # user's (no weights on the meta device, generation defaults): keep it quiet here.
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            loaded = transformers.AutoConfig.from_pretrained(
                str(config_dir), local_files_only=True, trust_remote_code=trust_remote_code)
            model = _build(transformers, torch, loaded, trust_remote_code)
    finally:
        logger.setLevel(level)
    if model is None:
        names = [str(a)[:80] for a in (config.get("architectures") or [])]
        return (f"transformers has no causal LM or image-text-to-text class for "
                f"{names or model_type!r}")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        source = first.setdefault(id(param), name)
        if source != name:  # the same parameter under a second name: the model ties it
            tied[name] = source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = saved_layout(torch, model)
    return ModelExpectation(type(model).__name__, shapes, tied, saved)


def _build(transformers: Any, torch: Any, config: Any, trust_remote_code: bool) -> Any:
    names = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls._from_config(config)
        # A config without architectures (built, not downloaded): the model type's causal
        # LM, else its image-text-to-text model (LLaVA and the other VLMs have no causal LM).
        for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
            if not hasattr(transformers, auto):  # transformers too old to have it
                continue
            try:
                return getattr(transformers, auto).from_config(
                    config, trust_remote_code=trust_remote_code)
            except ValueError:  # no such model for this model type
                continue
        return None


def tied_without_transformers(config: dict[str, Any], names: Collection[str]) -> dict[str, str]:
    """Tied keys from the config alone: ``lm_head.weight`` when ``tie_word_embeddings`` (True
    unless the config says otherwise, as transformers' default) and an input embedding is
    there to tie it to."""
    if not config.get("tie_word_embeddings", True) or _LM_HEAD not in names:
        return {}
    embeddings = sorted(n for n in names if n.endswith("embed_tokens.weight"))
    return {_LM_HEAD: embeddings[0]} if embeddings else {}

