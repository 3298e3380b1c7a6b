"""What is in a checkpoint (:mod:`~fsdpckpt.inspection.inspect`) and whether every byte is
what was written (:mod:`~fsdpckpt.inspection.verify`)."""
