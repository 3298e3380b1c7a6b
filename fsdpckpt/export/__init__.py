"""Exports: a sharded checkpoint to a folder other tools load as they are.

``hf.py`` (:func:`~fsdpckpt.export.hf.export_hf`: a Hugging Face model folder). Internal:
``_config.py`` (finding the config and tokenizer files where trainers leave them; the
config fixed for export), ``_model.py`` (what the config's model class expects: keys,
shapes, tied keys).
"""
