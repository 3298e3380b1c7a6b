"""From shards to whole files: validate -> plan -> write -> commit.

- :mod:`~fsdpckpt.merging.merger`: ``merge`` and ``merge_fsdp_weights``, the pipeline's driver;
- :mod:`~fsdpckpt.merging.plan`: ``plan_merge``, output files and byte ranges from metadata alone;
- :mod:`~fsdpckpt.merging.writer`: executes a plan into a staging folder and commits it;
- :mod:`~fsdpckpt.merging.full`: ``load_full_state_dict``, the same chunks into memory;
- :mod:`~fsdpckpt.merging.to_dcp`: ``convert``, the other way (whole files to a DCP folder).

Internal (``_``): the chunk-placing copy engine, dtype casts, key renaming.
The output formats themselves live in :mod:`fsdpckpt.formats`.
"""
