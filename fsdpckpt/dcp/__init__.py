"""The read side of DCP checkpoints, without torch: what is in a folder, and is it whole.

- :mod:`~fsdpckpt.dcp.metadata`: the pure data model of a ``.metadata`` file;
- :mod:`~fsdpckpt.dcp.reader`: ``read_dcp_folder``, the allowlisted parse into that model;
- :mod:`~fsdpckpt.dcp.layout`: where the parts of a checkpoint are (Accelerate, HF Trainer,
  plain DCP folders);
- :mod:`~fsdpckpt.dcp.checks`: structural checks (chunks tile each tensor, files present);
- :mod:`~fsdpckpt.dcp.dtypes`: the dtypes DCP can hold, by name.

Internal (``_``): the restricted unpickler (``_safe_pickle``) and what it may build
(``_allowlist``), the ``torch.save`` chunk-archive and zip readers (``_archive``,
``_ziparchive``), a folder's data files opened once for both (``_datafiles``), the codec of
non-tensor entries (``_objects``), nested key paths (``_nesting``) and the RNG-file decoder
(``_rngfile``).
"""
