"""``python -m fsdpckpt`` runs the command line."""

from fsdpckpt.cli import main

if __name__ == "__main__":
    main(prog_name="fsdpckpt")
