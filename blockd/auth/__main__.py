"""``python -m blockd.auth``: the token and certificate commands (:mod:`blockd.auth.cli`)."""

import sys

from blockd.auth.cli import main

sys.exit(main())
