"""``python -m post_training_cookbook``: the same command as ``post-training-cookbook``."""

import sys

from post_training_cookbook.cli import main

if __name__ == "__main__":
    sys.exit(main())
