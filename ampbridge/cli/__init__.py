"""The ``ampbridge`` command line (``main``) and the demo it runs (``ampbridge demo``).

Example:
    >>> main(["--version"])  # doctest: +SKIP
"""

from .commands import main

__all__ = ["main"]
