"""``python -m blockd``: the ``blockd`` console script (:mod:`blockd.cli`), for
environments where the script is not on PATH."""

import sys

from blockd.cli import main

sys.exit(main())
