"""`python -m blockdraft.train --config FILE`: what torchrun starts once per drafter device (the `train` command)."""

import sys

from blockdraft.cli import app

if __name__ == "__main__":
    sys.exit(app(["train", *sys.argv[1:]], prog_name="blockdraft"))
