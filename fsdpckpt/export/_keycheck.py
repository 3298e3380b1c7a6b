"""What export-hf checks the exported keys against, and what it will not do to check them.

Three rules, all decided from files alone (no transformers, no code from a checkpoint):

- :func:`custom_code`: a config whose ``auto_map`` (anywhere in it) names custom code is
  one transformers can only build by running that code. fsdpckpt runs it only when the
  user passes ``--trust-remote-code`` (``trust_remote_code=True``); otherwise transformers
  is never called on it, so it can neither run the code nor ask on stdin whether to.
- :func:`check_declared_sizes`: the layer and expert counts a config declares are bounded
  by what the checkpoint's own key names show, before the config's class is built: the
  build's work follows the checkpoint's size, not a number written in ``config.json``.
- :func:`check_against_base`: when the model class is not built (custom code, a
  ``model_type`` transformers does not know, no transformers), the keys are checked
  against the ``--base`` folder's own weight names (its ``model.safetensors.index.json``,
  or its safetensors headers, with their shapes), and what was not checked is said.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._hfstorage import SafetensorsHeader
from fsdpckpt.errors import ExportMismatchError
from fsdpckpt.export._code_files import check_inside
from fsdpckpt.export._config import CONFIG
from fsdpckpt.formats._shards import MAX_INDEX_BYTES, read_header, read_shard_index

__all__ = ["ExportMismatchError", "custom_code", "custom_code_reason", "check_declared_sizes",
           "declared_bound", "numbered_siblings", "base_weights", "check_against_base",
           "key_problems"]


Shape = tuple[int, ...]

#: Config fields that count layers (transformers' names across model families).
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                "num_encoder_layers", "encoder_layers", "decoder_layers")
#: Config fields that count experts (Mixtral, Qwen-MoE, DeepSeek, OLMoE...).
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: How many of a key's numbered segments count (layers.N, experts.M: the first two).
_SEGMENTS = 4
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_SHOWN = 5


def _sub_configs(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    # The config and every config nested in it (text_config, vision_config...), with the
    # dotted path to each; iterative, each object once (parse_json bounds the depth).
    todo: list[tuple[str, dict[str, Any]]] = [("", config)]
    while todo:
        where, doc = todo.pop()
        yield where, doc
        todo += [(f"{where}{key}.", value) for key, value in doc.items()
                 if isinstance(value, dict)]


def custom_code(config: dict[str, Any]) -> list[str]:
    """The custom code the config's ``auto_map`` entries name (``modeling_x.XForCausalLM``);
    empty when it names none, so transformers' own classes build it."""
    refs: list[str] = []
    for _where, doc in _sub_configs(config):
        auto_map = doc.get("auto_map")
        if not auto_map:
            continue
        named = []
        for value in auto_map.values() if isinstance(auto_map, dict) else [auto_map]:
            named += [str(r)[:200] for r in (value if isinstance(value, list) else [value])
                      if r is not None]
        refs += named or [str(auto_map)[:200]]  # naming nothing readable: still custom
    return refs


def numbered_siblings(shapes: dict[str, Shape]) -> int:
    """The most numbered siblings the keys show: the distinct ``N`` after one prefix
    (``model.layers.N.``, ``...experts.M.``), at most the number of keys."""
    groups: dict[str, set[str]] = {}
    for name in shapes:
        parts = name.split(".")
        seen = 0
        for i, part in enumerate(parts[:-1]):
            if part.isascii() and part.isdigit():
                groups.setdefault(".".join(parts[:i]), set()).add(part)
                seen += 1
                if seen == _SEGMENTS:
                    break
    return max((len(v) for v in groups.values()), default=0)


def _fused_experts(shapes: dict[str, Shape]) -> int:
    # transformers 5 stores a layer's experts as one tensor ([experts, ...]): the most
    # experts such a tensor holds (only one with data: its bytes bound the count).
    return max((s[0] for n, s in shapes.items() if "expert" in n and len(s) >= 3
                and math.prod(s) > 0), default=0)


def declared_bound(seen: int) -> int:
    """The most a config may declare where the keys show ``seen``: generous (a pipeline
    stage's checkpoint holds some of the layers), and linear in the checkpoint."""
    return 2 * seen + 8


def check_declared_sizes(config: dict[str, Any], shapes: dict[str, Shape],
                         config_path: Place) -> None:
    """Refuse a config whose layer or expert counts are beyond what the keys show.

    Building the config's class costs time and memory per layer and per expert, so a
    count is checked against :func:`numbered_siblings` (and, for experts, fused expert
    tensors) before anything is built, with :func:`declared_bound` as the limit.

    Raises:
        ExportMismatchError: a count over the bound; the message names ``config_path``,
            the field, the declared value and the count the keys show.
    """
    numbered = numbered_siblings(shapes)
    counts = {"layers": numbered, "experts": max(numbered, _fused_experts(shapes))}
    for where, doc in _sub_configs(config):
        for fields, what in ((LAYER_FIELDS, "layers"), (EXPERT_FIELDS, "experts")):
            for field in fields:
                value = doc.get(field)
                if type(value) is not int or value <= declared_bound(counts[what]):
                    continue
                raise ExportMismatchError(
                    f"{config_path}: {where}{field} is {value}, but the checkpoint's keys show "
                    f"{counts[what]} numbered {what} at most, so this config does not describe "
                    f"this checkpoint (nothing was built or written); pass base= with the "
                    f"config of the model this run trained")


def key_problems(shapes: Mapping[str, Shape], wanted: Mapping[str, Shape | None],
                 tied: Collection[str] = ()) -> list[str]:
    """What the exported tensors (``shapes``: name -> shape, tied targets left out) lack or
    have too many of, against ``wanted`` (name -> shape, or None where only the name is
    known); tied targets in ``wanted`` are not expected. Empty when they match."""
    expected = {k: v for k, v in wanted.items() if k not in tied}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(wanted))
    wrong = sorted(k for k in set(shapes) & set(expected)
                   if expected[k] is not None and tuple(shapes[k]) != expected[k])
    problems = []
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            problems.append(f"{len(keys)} {what} ({', '.join(keys[:_SHOWN])}{more})")
    if wrong:
        shown = ", ".join(f"{k} is {list(shapes[k])}, expected {list(expected[k] or ())}"
                          for k in wrong[:_SHOWN])
        problems.append(f"{len(wrong)} of the wrong shape ({shown})")
    return problems


def _header(file: Place) -> SafetensorsHeader:
    # The checked header of a safetensors file (the one parser), by ranged reads.
    check_inside(file, file.parent)  # a hub snapshot's links into blobs/ are inside
    return read_header(file)


#: How a base folder's shard index that cannot be read is refused (formats._shards.Wording).
_INDEX_WORDING = {
    "size": f"{{index}}: {{detail}} bytes, over the {MAX_INDEX_BYTES} a shard index may have; "
            "pass base= with an intact model folder",
    "json": "{index}: cannot read it as JSON ({detail}); pass base= with an intact model "
            "folder",
    # Said with the flag: tests/test_shard_index.py pins "pass --base" on this one.
    "*": "{index}: not a shard index (a 'weight_map' of names to file names in its folder); "
         "pass --base with an intact model folder",
}


def base_weights(base: Place) -> tuple[dict[str, Shape | None], Place] | None:
    """The base folder's weight names, with their shapes where its safetensors files are
    there to read, and the file they come from; None when it holds no weights.

    Raises:
        NotACheckpointError: the index is not a JSON object with a ``weight_map`` of names
            to plain file names.
        CorruptCheckpointError: a safetensors header is damaged.
    """
    index = base / _INDEX
    if index.is_file():
        shards = read_shard_index(index, wording=_INDEX_WORDING)
        weight_map, files = shards.weight_map, shards.files
        if not all(f.is_file() for f in files):  # the names alone
            return {str(name): None for name in weight_map}, index
        found: dict[str, Shape | None] = {}
        for file in files:
            found.update({n: shape for n, (_, shape, _, _) in _header(file).tensors.items()})
        return found, index
    single = base / _SINGLE
    if single.is_file():
        return {n: shape for n, (_, shape, _, _) in _header(single).tensors.items()}, single
    return None


def check_against_base(shapes: dict[str, Shape], tied: Collection[str], base: Place | None,
                       reason: str, source: object) -> str:
    """Check the exported keys against the base's weights when the model class is not built.

    Args:
        shapes: the exported tensors (name -> shape), tied targets left out.
        tied: the tied targets (a base saved by ``save_pretrained`` leaves them out too).
        base: the ``--base`` folder, if given.
        reason: why the model class was not built (``"config.json's auto_map names custom
            code..."``).
        source: the checkpoint, for the message.

    Returns:
        What was not checked, as one line for the user (``ExportResult.not_checked``).

    Raises:
        ExportMismatchError: the keys (or shapes) differ from the base's weights.
    """
    weights = base_weights(base) if base is not None else None
    if weights is None:
        # Said with the flag: tests/test_export_remote_code.py pins "--base" in not_checked.
        fix = (f"{base} holds no {_SINGLE} or {_INDEX} to check them against" if base
               is not None else "pass --base with the model folder the run started from to "
               "check them against its weights")
        return f"keys and shapes ({reason}); {fix}"
    wanted, where = weights
    problems = key_problems(shapes, wanted, tied)
    if problems:
        raise ExportMismatchError(
            f"{source}: does not match the base's weights ({where}): " + "; ".join(problems)
            + f"; the model class was not built to check ({reason}): pass base= with the "
            "model folder this run trained from")
    what = "keys and shapes" if all(v is not None for v in wanted.values()) else "keys"
    return f"the model class ({reason}); the {what} were checked against {where} instead"


def custom_code_reason(refs: list[str]) -> str:
    """Why a custom-code model's class is not built: one phrase for the user."""
    shown = ", ".join(refs[:3]) + (f" and {len(refs) - 3} more" if len(refs) > 3 else "")
    return (f"{CONFIG}'s auto_map names custom code ({shown}), which fsdpckpt runs only with "
            "--trust-remote-code")
