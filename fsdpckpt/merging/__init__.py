"""From shards to whole files: validate -> plan -> write -> commit, plain data between stages.

- :mod:`~fsdpckpt.merging.merger`: ``merge`` and ``merge_fsdp_weights``, the pipeline's driver,
  its plan/write/commit stage functions (``plan_job``, ``write_job``, ``commit_job``), and
  ``run_job``, the one choice of output strategy;
- :mod:`~fsdpckpt.merging.plan`: ``plan_merge``, output files and byte ranges from metadata alone;
- :mod:`~fsdpckpt.merging.writer`: executes a plan into a staging folder and commits it;
- :mod:`~fsdpckpt.merging.full`: ``load_full_state_dict``, the same chunks into memory;
- :mod:`~fsdpckpt.merging.to_dcp`: ``convert``, the other way (whole files to a DCP folder).

Internal (``_``): the validate stage (``_validate``), the job types and the commit stage
(``_jobs``), the output strategies (``_remote_out``, ``_distributed``, ``_distributed_remote``),
which earlier outputs a merge replaces (``_outputs``), where a chunk's elements land
(``_runs``), the chunk-placing copy engine (``_copy``), dtype casts (``_casts``) and which
dtype each tensor gets (``_dtype_policy``), key renaming (``_keys``).
The output formats themselves live in :mod:`fsdpckpt.formats`; source data files are read
through :class:`fsdpckpt.dcp._datafiles.DataFiles`.
"""
