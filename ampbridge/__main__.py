"""``python -m ampbridge`` is the ``ampbridge`` command."""

import sys

from .cli import main

sys.exit(main())
