"""Training-side checkpoints: what training code calls.

- :mod:`~fsdpckpt.training.state`: ``save_state`` / ``load_state`` in Accelerate's layout;
- :mod:`~fsdpckpt.training.manager`: ``CheckpointManager``, commit, latest, retention;
- :mod:`~fsdpckpt.training.manifest`: ``fsdpckpt.json``, written on save, read by verify.

Internal (``_``): distributed helpers (``_dist``: rank, world, ``everywhere``, async groups),
Accelerate's file names (``_layout``), the safe DCP storage reader, RNG state, the
model-against-checkpoint check.
"""
