"""``python -m tearless …``: the same as the ``tearless`` command."""

import sys

from tearless.cli import main

sys.exit(main())
