"""``python -m client.cli``: ``blockctl``, where the console script is not on PATH."""

import sys

from client.cli import main

sys.exit(main())
