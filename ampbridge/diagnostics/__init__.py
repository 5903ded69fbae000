"""Diagnostics, framework-free: the run log a monitor writes (``runlog``), ``ampbridge report``
(``report``), ``ampbridge doctor`` (``doctor``), what the hardware runs natively and what
``compute_dtype = "auto"`` picks (``hardware``), and the bisect switch ``AMPBRIDGE_DISABLE`` /
``AMPBRIDGE_POLICY`` (``environment``).
"""
