"""The ``ampbridge`` command line (``main``) and the demo it runs (``ampbridge demo``).

Example:
    >>> main(["--version"])  # doctest: +SKIP
"""

from .main import main

__all__ = ["main"]
