"""``python -m blockd.cli``: the ``blockd`` console script (the compactor child is started this way)."""

import sys

from blockd.cli import main

sys.exit(main())
