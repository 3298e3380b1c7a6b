"""The Hugging Face files beside the weights: where to find them, and the config fixed for export.

Pure file work, no torch, no transformers: :func:`find_side_files` looks where trainers leave
``config.json``, the tokenizer and the processor, :func:`exported_config` rewrites the config
for the exported weights (``architectures`` without FSDP2's ``FSDP`` prefix, the dtype field),
:func:`generation_config` makes the one transformers makes from a config. The file names are
kept here: export-hf runs without transformers (tests/test_export_side_files.py checks them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fsdpckpt._io import storage_paths
from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError
from fsdpckpt.export._code_files import MAX_CONFIG_BYTES as _MAX_CONFIG_BYTES
from fsdpckpt.export._code_files import check_inside, code_files

__all__ = ["SideFiles", "CONFIG", "MAX_SIDE_BYTES", "GENERATION_CONFIG", "TOKENIZER_FILES",
           "PROCESSOR_FILES", "GENERATION_FIELDS", "find_side_files", "side_file_bytes",
           "exported_config", "strip_fsdp_prefix", "read_config", "config_bytes",
           "generation_config"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
#: Every file a tokenizer (fast or slow, of any class's ``vocab_files_names``) and its chat
#: template (``chat_template.json``: the legacy processor one) may be saved as.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
                   "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "bpe.codes",
                   "prophetnet.tokenizer", "normalizer.json", "entity_vocab.json",
                   "vocab-src.json", "vocab-tgt.json", "emoji.json", "byte_maps.json",
                   "word_shape.json", "word_pronunciation.json", "dict.txt", "spm_char.model",
                   "source.spm", "target.spm", "target_vocab.json")
#: What a processor's ``save_pretrained`` writes besides its tokenizer: the unified processor
#: config, and (transformers 4, still read) the image/feature and video processor configs.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json",
                   "video_preprocessor_config.json")
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: A folder of .jinja templates (transformers 5 saves extra named chat templates there).
_TEMPLATES_DIR = "additional_chat_templates"

#: The largest side file copied (a large vocabulary's tokenizer.json is tens of MB): each is
#: read whole, so this bounds the memory a copy takes.
MAX_SIDE_BYTES = 128 * 2**20

#: FSDP2's ``fully_shard`` renames the class to ``FSDP<Class>``.
_FSDP_PREFIX = re.compile(r"^FSDP(?=[A-Z])")


@dataclass(frozen=True)
class SideFiles:
    """Where the files beside the weights come from.

    Attributes:
        config: the ``config.json`` to export (read, then rewritten).
        copied: the other files copied as they are (generation config, tokenizer, processor,
            chat template), as (source path, name in the output).
        looked: the folders searched, in order.
        made: files written that no folder holds, as (name, bytes): the generation config
            transformers makes from the config, where none was found and the model generates.
        no_tokenizer: where no tokenizer was found, one line saying so (where it looked, and
            how to include one); None when one was.
    """

    config: Place
    copied: tuple[tuple[Place, str], ...]
    looked: tuple[Place, ...]
    made: tuple[tuple[str, bytes], ...] = ()
    no_tokenizer: str | None = None


#: The side folder VeRL (and some trainers) leave the HF files in: inside the checkpoint,
#: and in the run folder above it.
_HF_DIR = "huggingface"
_CONTAINED = ("export-hf copies side files only from inside the folders they are looked up "
              "in, never through a link out of them")


def _candidates(checkpoint_root: Place) -> list[tuple[Place, Place | None]]:
    # Where trainers leave the HF files: the checkpoint folder (HF Trainer), VeRL's
    # huggingface/ inside it, and the run's output folder above it (Accelerate and HF
    # Trainer runs: output/checkpoint-500), with its huggingface/ too. Each with the folder
    # a huggingface/ is looked up in, which it must not lead out of.
    found: list[tuple[Place, Place | None]] = []
    for folder, parent in ((checkpoint_root, None),
                           (checkpoint_root / _HF_DIR, checkpoint_root),
                           (checkpoint_root.parent, None),
                           (checkpoint_root.parent / _HF_DIR, checkpoint_root.parent)):
        if folder not in [f for f, _ in found]:
            found.append((folder, parent))
    return found


class _Search:
    """The folders side files are looked for in, in order. A ``huggingface/`` side folder
    is judged the first time a search reaches it, by where it leads
    (:func:`~fsdpckpt._io.storage_paths.leads_out`): one that is a link out of the folder it
    is looked up in refuses the export, in one line naming it, and is never looked in (its
    bytes would go into a folder made for upload). The folders the caller names (the
    checkpoint, the run folder above it, a base) are its own."""

    def __init__(self, folders: list[tuple[Place, Place | None]]) -> None:
        self.folders = [folder for folder, _ in folders]
        self._unjudged = {folder: parent for folder, parent in folders if parent is not None}

    def looked(self, folders: list[Place]) -> Iterator[Place]:
        for folder in folders:
            parent = self._unjudged.pop(folder, None)
            out = None if parent is None else storage_paths.leads_out(parent, folder.name)
            if parent is not None and out is not None:
                raise storage_paths.link_refusal(
                    folder, out, parent, _CONTAINED, what="the folder",
                    fix=f"pass --base {storage_paths.shown(out)} if that is the model folder "
                        "the run started from, or put a copy in place of the link")
            yield folder


def _has_tokenizer(folder: Place) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_MARKERS)


def find_side_files(checkpoint_root: Place, base: Place | None) -> SideFiles:
    """The config, generation config, tokenizer and processor files, chat templates and custom
    code to export.

    With ``base`` (a Hugging Face model folder), they come from there alone. Without it,
    the config comes from the first of the folders trainers leave it in that holds one
    (the checkpoint folder, its ``huggingface/``, the run's output folder above it and its
    ``huggingface/``); the tokenizer likewise, and the generation config from the config's
    folder, else the first that holds one (none: made as transformers' ``save_pretrained``
    makes it, :func:`generation_config`). The processor's files (its other tokenizers in
    their ``*_tokenizer/``) and ``additional_chat_templates/`` come with the tokenizer; the
    custom code ``auto_map`` names (trust_remote_code models), and the modules it imports
    relatively, with the config (and the tokenizer's, with it). No symlink is followed out
    of the folder a file comes from, each file judged before it is read, nor a
    ``huggingface/`` folder that links out of the folder it is looked up in (:class:`_Search`).
    Either may be on object storage
    (:class:`~fsdpckpt._io.remote.RemotePath`): the files are then found in its listings,
    and read by :func:`side_file_bytes`.

    No tokenizer found is no error (a run trained from a config has none): the export
    goes without, and :attr:`SideFiles.no_tokenizer` says so in one line.

    Raises:
        CheckpointNotFoundError: ``base`` is not a folder; no ``config.json`` was found (the
            message lists where it looked and says to pass ``base``); a custom code file
            ``auto_map`` needs is missing.
        NotACheckpointError: a side file is a symlink out of its folder, or a ``huggingface/``
            folder searched is one out of the folder above it; ``auto_map``
            names something that is not a module name; the config is not a JSON object
            with a ``model_type`` (where a generation config is to be made from it).
    """
    if base is not None:
        if not base.is_dir():
            raise CheckpointNotFoundError(f"{base}: not a folder; pass base= with the Hugging "
                                          "Face model folder the run started from")
        search = _Search([(base, None)])
    else:
        search = _Search(_candidates(checkpoint_root))
    folders = search.folders
    where = ", ".join(str(f) for f in folders)
    # The first said with the flag: tests/test_export_hf.py pins "--base" on it.
    hint = ("pass --base with the model folder the run started from" if base is None else
            "pass base= with a folder that holds it (the one from_pretrained loaded)")
    config = next((f / CONFIG for f in search.looked(folders) if (f / CONFIG).is_file()),
                  None)
    if config is None:
        raise CheckpointNotFoundError(f"no {CONFIG} found for {checkpoint_root}; looked in "
                                      f"{where}; {hint}")
    check_inside(config, config.parent)  # before it is read: read_config, code_files
    tokenizer = next((f for f in search.looked([config.parent, *folders])
                      if _has_tokenizer(f)), None)
    copied: list[tuple[Place, str]] = []
    no_tokenizer = None
    if tokenizer is None:
        no_tokenizer = (f"no tokenizer (tokenizer.json, tokenizer_config.json or "
                        f"tokenizer.model) in {where}: the export has none; to include one, "
                        + ("pass --base with the model folder the run started from"
                           if base is None else "pass a base that holds it"))
    else:
        copied += _tokenizer_files(tokenizer)
        for source, _name in copied:  # before code_files reads tokenizer_config.json
            check_inside(source, source.parent)
    generation = next((f / GENERATION_CONFIG for f in search.looked([config.parent, *folders])
                       if (f / GENERATION_CONFIG).is_file()), None)
    made: list[tuple[str, bytes]] = []
    if generation is not None:
        check_inside(generation, generation.parent)
        copied.insert(0, (generation, GENERATION_CONFIG))
    else:  # as VeRL's merger and transformers' save_pretrained: made from the config
        doc = generation_config(read_config(config))
        if doc is not None:
            made.append((GENERATION_CONFIG, config_bytes(doc)))
    # Custom code (trust_remote_code): the modules the config's and the tokenizer's
    # auto_map name, with the modules they import relatively, from the folder beside each.
    code = code_files(config, config.parent)
    if tokenizer is not None and (tokenizer / "tokenizer_config.json").is_file():
        code += [c for c in code_files(tokenizer / "tokenizer_config.json", tokenizer)
                 if c[1] not in {name for _, name in code}]
    copied += code  # each checked by code_files before it was read
    return SideFiles(config, tuple(copied), tuple(folders), tuple(made), no_tokenizer)


def _tokenizer_files(tokenizer: Place) -> list[tuple[Place, str]]:
    """The tokenizer's and processor's files in ``tokenizer``, with a processor's other
    tokenizers (each in the folder its attribute names: InstructBLIP's
    ``qformer_tokenizer/``, where from_pretrained reads them) and the chat templates."""
    copied = [(tokenizer / name, name) for name in TOKENIZER_FILES + PROCESSOR_FILES
              if (tokenizer / name).is_file()]
    others: list[Place] = list(tokenizer.glob("*_tokenizer"))
    for sub in sorted(others, key=str):
        if sub.is_dir() and _has_tokenizer(sub):
            check_inside(sub, tokenizer)
            copied += [(sub / n, f"{sub.name}/{n}") for n in TOKENIZER_FILES
                       if (sub / n).is_file()]
    templates = tokenizer / _TEMPLATES_DIR
    if templates.is_dir():
        check_inside(templates, tokenizer)
        jinja: list[Place] = list(templates.glob("*.jinja"))
        copied += [(p, f"{_TEMPLATES_DIR}/{p.name}") for p in sorted(jinja, key=str)
                   if p.is_file()]
    return copied


def strip_fsdp_prefix(name: str) -> str:
    """``FSDPQwen2ForCausalLM`` -> ``Qwen2ForCausalLM``; other names unchanged."""
    return _FSDP_PREFIX.sub("", name)


def side_file_bytes(path: Place) -> bytes:
    """The bytes of a side file to copy, its size checked before it is read.

    Raises:
        NotACheckpointError: it is over :data:`MAX_SIDE_BYTES`, so no side file.
        CorruptCheckpointError: a remote file shorter than its listing.
    """
    size = path.stat().st_size
    if size > MAX_SIDE_BYTES:
        raise NotACheckpointError(f"{path}: {size} bytes, over the {MAX_SIDE_BYTES} a "
                                  "config, tokenizer or chat template file may have; pass "
                                  "base= with the Hugging Face model folder")
    return path.read_bytes()


def read_config(path: Place) -> dict[str, Any]:
    """``config.json`` as a dict.

    Raises:
        NotACheckpointError: it is not a JSON object with a ``model_type``.
    """
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"it is over {_MAX_CONFIG_BYTES} bytes")
        config = parse_json(path.read_bytes())
    except (ValueError, OSError) as exc:
        raise NotACheckpointError(f"{path}: cannot read it as JSON ({exc}); pass base= with "
                                  "a Hugging Face model folder") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise NotACheckpointError(f"{path}: has no model_type, so transformers cannot tell "
                                  "which model it is; pass base= with the model folder the "
                                  "run started from")
    return config


def _legacy_dtype(section: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes ``dtype``, never the legacy ``torch_dtype``: a sub-config's moves.
    out = {k: _legacy_dtype(v) if isinstance(v, dict) else v for k, v in section.items()}
    legacy = out.pop("torch_dtype", None)
    if legacy is not None and out.get("dtype") is None:
        out["dtype"] = legacy
    return out


def exported_config(config: dict[str, Any], dtype_name: str, *,
                    untie: bool = False) -> dict[str, Any]:
    """The config written beside the exported weights.

    ``architectures`` loses FSDP2's ``FSDP`` class prefix; ``dtype`` is set to ``dtype_name``
    (``"bfloat16"``...), as transformers 5's ``save_pretrained`` writes it: the legacy
    ``torch_dtype`` key is dropped (a sub-config's becomes its ``dtype``). With ``untie``,
    ``tie_word_embeddings`` is set to false (the output embeddings are written as their own
    tensor).

    Example:
        >>> exported_config({"model_type": "llama", "torch_dtype": "float32"}, "bfloat16")
        {'model_type': 'llama', 'dtype': 'bfloat16'}
    """
    out = _legacy_dtype(config)
    if untie:
        out["tie_word_embeddings"] = False
    archs = out.get("architectures")
    if isinstance(archs, list):
        out["architectures"] = [strip_fsdp_prefix(a) if isinstance(a, str) else a
                                for a in archs]
    out["dtype"] = dtype_name
    return out


#: Every setting of transformers' ``GenerationConfig`` (5.x), each ``None`` by default.
GENERATION_FIELDS = (
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time",
    "stop_strings", "do_sample", "num_beams", "use_mtp", "use_cache", "cache_implementation",
    "cache_config", "max_cache_len", "temperature", "top_k", "top_p", "min_p", "top_h",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
    "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "sequence_bias", "token_healing", "guidance_scale", "watermarking_config",
    "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "pad_token_id", "bos_token_id", "eos_token_id",
    "encoder_no_repeat_ngram_size", "decoder_start_token_id", "is_assistant",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit",
    "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight", "speculation_type",
    "compile_config", "disable_compile", "continuous_batching_config", "low_memory",
    "penalty_alpha", "dola_layers", "diversity_penalty", "num_beam_groups", "constraints",
    "force_words_ids", "prefill_chunk_size")
#: The flags that make ``generate`` return a dict (GenerationConfig.extra_output_flags).
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")
#: Where a composite config keeps its decoder's (get_text_config(decoder=True)).
_DECODER_CONFIGS = ("decoder", "generator", "text_config")
#: The classes that generate: those VeRL's merger builds as such, and GPT-2's LMHeadModel.
_GENERATES = re.compile(r"(ForCausalLM|ForConditionalGeneration|LMHeadModel)$")


def generation_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The generation config transformers' ``save_pretrained`` writes for a model built from
    ``config`` (``GenerationConfig.from_model_config``, as VeRL's merger does), made without
    transformers: a default of the config class that ``config.json`` omits is not known.

    Args:
        config: ``config.json`` as read.

    Returns:
        The generation settings the config (then its decoder's) holds, ``output_attentions``
        and ``output_hidden_states`` false, ``_from_model_config``, the config's
        ``transformers_version``; None when ``architectures`` names no class that generates.

    Example:
        >>> made = generation_config({"architectures": ["LlamaForCausalLM"], "eos_token_id": 2})
        >>> made["eos_token_id"], made["output_attentions"], made["_from_model_config"]
        (2, False, True)
    """
    archs = config.get("architectures")
    if not isinstance(archs, list) or not any(
            isinstance(a, str) and _GENERATES.search(strip_fsdp_prefix(a)) for a in archs):
        return None
    # PreTrainedConfig's own defaults: to_dict() carries them though config.json omits them.
    merged = {"output_attentions": False, "output_hidden_states": False, **config}
    decoder: dict[str, Any] = next((c for n in _DECODER_CONFIGS
                                    if isinstance(c := config.get(n), dict)), {})
    out: dict[str, Any] = {}
    for key in GENERATION_FIELDS:  # the config's, else its decoder's
        value = merged.get(key) if merged.get(key) is not None else decoder.get(key)
        if value is not None:
            out[key] = value
    if any(out.get(flag) for flag in _OUTPUT_FLAGS) and not out.get("return_dict_in_generate"):
        out["return_dict_in_generate"] = True
    out["_from_model_config"] = True
    if isinstance(config.get("transformers_version"), str):
        out["transformers_version"] = config["transformers_version"]
    return out


def config_bytes(config: dict[str, Any]) -> bytes:
    """The config as transformers writes it: indented JSON, sorted keys, a final newline."""
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
