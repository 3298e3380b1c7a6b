"""The trainers' model families whose names export-hf converts: each family's names, the
config ``model_type`` it is converted for, and what its converter does.

A family is chosen from the checkpoint's keys and the base config together
(:func:`fsdpckpt.export._trainer_names.trainer_names`): every key must be one of the family's
names, and the config's ``model_type`` one the family's converter is for. Keys alone do not
tell: torchtune's Llama, Mistral, Gemma and Phi-3 models have the same module names, and
their converters differ (Phi-3's fuses q, k and v); Gemma 2's norms (``sa_scale``,
``norm.rms_norm``) and torchtitan's Qwen 3 q/k norms are names no other family has.

Each table maps the trainer's name to the hub's, ``{}`` a layer number, as the converter's
own table does (torchtune's ``convert_weights._FROM_HF`` and
``gemma2._convert_weights._GEMMA2_FROM_HF``, torchtitan's adapters' ``from_hf_map``),
inverted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "hub_name"]

_LAYER = "model.layers.{}."
Q = _LAYER + "self_attn.q_proj.weight"
K = _LAYER + "self_attn.k_proj.weight"


@dataclass(frozen=True)
class Family:
    """One trainer's names for one kind of model.

    Attributes:
        trainer: whose names (``"torchtune"``, ``"torchtitan"``).
        names: the trainer's name -> the hub's (``{}`` a layer number).
        model_types: the config ``model_type`` values it is converted for.
        reorder: whether q's and k's rows are reordered within each head (the converter's
            rotary layout is not Hugging Face's).
        converter: the trainer's own converter, for messages.
    """

    trainer: str
    names: Mapping[str, str]
    model_types: tuple[str, ...]
    reorder: bool
    converter: str


_TUNE_LLAMA = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.scale": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attn.q_proj.weight": Q,
    "layers.{}.attn.k_proj.weight": K,
    "layers.{}.attn.v_proj.weight": _LAYER + "self_attn.v_proj.weight",
    "layers.{}.attn.output_proj.weight": _LAYER + "self_attn.o_proj.weight",
    "layers.{}.mlp.w1.weight": _LAYER + "mlp.gate_proj.weight",
    "layers.{}.mlp.w3.weight": _LAYER + "mlp.up_proj.weight",
    "layers.{}.mlp.w2.weight": _LAYER + "mlp.down_proj.weight",
    "layers.{}.sa_norm.scale": _LAYER + "input_layernorm.weight",
    "layers.{}.mlp_norm.scale": _LAYER + "post_attention_layernorm.weight",
}
# gemma2_tune_to_hf's table: mlp_norm (torchtune applies it before the MLP) is the hub's
# post_feedforward_layernorm and mlp_scale (after) its pre_feedforward_layernorm. A run that
# started from hub weights gets each back in its place; torchtune's own Gemma 2 computes with
# the two exchanged (docs/torchtune.md).
_TUNE_GEMMA2 = {
    **{k: v for k, v in _TUNE_LLAMA.items() if k != "norm.scale"},
    "norm.rms_norm.scale": "model.norm.weight",
    "layers.{}.sa_scale.scale": _LAYER + "post_attention_layernorm.weight",
    "layers.{}.mlp_norm.scale": _LAYER + "post_feedforward_layernorm.weight",
    "layers.{}.mlp_scale.scale": _LAYER + "pre_feedforward_layernorm.weight",
}
# Both of torchtitan's namings: attention.wq (before qkv_linear) and output (before lm_head)
# are the older ones.
_TITAN_LLAMA = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": Q,
    "layers.{}.attention.wk.weight": K,
    "layers.{}.attention.wv.weight": _LAYER + "self_attn.v_proj.weight",
    "layers.{}.attention.qkv_linear.wq.weight": Q,
    "layers.{}.attention.qkv_linear.wk.weight": K,
    "layers.{}.attention.qkv_linear.wv.weight": _LAYER + "self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": _LAYER + "self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": _LAYER + "mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": _LAYER + "mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": _LAYER + "mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": _LAYER + "input_layernorm.weight",
    "layers.{}.ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
}
_TUNE = "convert_weights.tune_to_hf"
FAMILIES: dict[str, Family] = {
    "torchtune Llama": Family("torchtune", _TUNE_LLAMA, ("llama",), True, _TUNE),
    # torchtune's checkpointer converts Mistral and Gemma models with tune_to_hf too; a
    # Gemma's output is tied (no output.weight), its head size the config's head_dim.
    "torchtune Mistral": Family("torchtune", _TUNE_LLAMA, ("mistral",), True, _TUNE),
    "torchtune Gemma": Family("torchtune", _TUNE_LLAMA, ("gemma",), True, _TUNE),
    "torchtune Gemma 2": Family("torchtune", _TUNE_GEMMA2, ("gemma2",), True,
                                "gemma2_tune_to_hf"),
    # Qwen2's rotary layout is Hugging Face's: renamed, rows kept.
    "torchtune Qwen2": Family("torchtune", {**_TUNE_LLAMA, **{
        f"layers.{{}}.attn.{p}_proj.bias": _LAYER + f"self_attn.{p}_proj.bias"
        for p in "qkv"}}, ("qwen2",), False, "qwen2_tune_to_hf"),
    "torchtitan Llama 3": Family("torchtitan", _TITAN_LLAMA, ("llama",), True,
                                 "Llama3StateDictAdapter.to_hf"),
    # Qwen 3's rotary embedding (CosSinRoPE) is Hugging Face's: renamed, rows kept.
    "torchtitan Qwen 3": Family("torchtitan", {**_TITAN_LLAMA, **{
        f"layers.{{}}.attention.{p}_norm.weight": _LAYER + f"self_attn.{p}_norm.weight"
        for p in "qk"}}, ("qwen3",), False, "Qwen3StateDictAdapter.to_hf"),
}


def _patterns(names: Mapping[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile(re.escape(name).replace(r"\{\}", r"(\d+)") + r"\Z"), hub)
            for name, hub in names.items()]


_COMPILED = {family: _patterns(f.names) for family, f in FAMILIES.items()}


def hub_name(family: str, key: str) -> tuple[str, str] | None:
    """The hub name of ``key`` in ``family`` and its template (``model.layers.{}...``);
    None when ``key`` is none of the family's names.

    Example:
        >>> hub_name("torchtune Llama", "layers.3.attn.q_proj.weight")
        ('model.layers.3.self_attn.q_proj.weight', 'model.layers.{}.self_attn.q_proj.weight')
    """
    for pattern, hub in _COMPILED[family]:
        found = pattern.match(key)
        if found:
            return hub.format(*found.groups()), hub
    return None
