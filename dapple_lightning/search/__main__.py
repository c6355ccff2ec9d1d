"""``python -m dapple_lightning.search``: see :mod:`dapple_lightning.search._cli`."""

import sys

from dapple_lightning.search._cli import main

sys.exit(main())
