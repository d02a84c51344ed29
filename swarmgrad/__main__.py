"""``python -m swarmgrad ...``: the same as the ``swarmgrad`` command."""

import sys

from swarmgrad.cli.main import main

sys.exit(main())
