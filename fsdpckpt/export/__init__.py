"""From shards to a model people can run: Hugging Face folders and LoRA adapters.

``hf.py`` (:func:`~fsdpckpt.export.hf.export_hf`: a Hugging Face model folder) and
``lora.py`` (LoRA/PEFT adapters: export them, or fuse them into the base weights).
Internal: ``_config.py`` (finding the config and tokenizer files where trainers leave them;
the config fixed for export), ``_model.py`` (what the config's model class expects: keys,
shapes, tied keys), ``_lora_*.py`` (adapter config, key names, reading and writing).
"""
