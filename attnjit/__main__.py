"""``python -m attnjit``: the ``attnjit`` command."""

import sys

from .cli import main

sys.exit(main())
