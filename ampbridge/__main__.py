"""``python -m ampbridge`` is the ``ampbridge`` command."""

import sys

from ._cli import main

sys.exit(main())
