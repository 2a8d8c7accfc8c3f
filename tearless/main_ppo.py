"""``python -m tearless.main_ppo key=value …``: veRL's entry point name, same as ``tearless train``."""

import sys

from tearless.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
