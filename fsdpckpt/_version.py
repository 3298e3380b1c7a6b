"""The package's version, in a module of its own: what writes it into a manifest (and the
CLI's ``--version``) imports it from here, not from the package, whose namespace names
every public module (a cycle otherwise)."""

__version__ = "0.1.0"
