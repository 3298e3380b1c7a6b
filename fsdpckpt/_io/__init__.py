"""Internal: file I/O that loops until done (``rawio``), durable writes (``durable``), JSON
from files (``jsonio``) and checksums recorded while writing (``checksums``)."""
