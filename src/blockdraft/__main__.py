"""`python -m blockdraft ...` is the `blockdraft` command; torchrun starts each training rank this way."""

import sys

from blockdraft.cli import app

if __name__ == "__main__":
    sys.exit(app(sys.argv[1:], prog_name="blockdraft"))
