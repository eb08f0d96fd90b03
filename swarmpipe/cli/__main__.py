"""``python -m swarmpipe.cli ROLE ...``: the same as the ``swarmpipe`` console script."""

import sys

from swarmpipe.cli.main import main

sys.exit(main())
