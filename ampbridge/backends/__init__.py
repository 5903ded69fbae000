"""One adapter package per framework (``torch``, ``keras``, ``jax``), each with the same rooms for
the same jobs, so a behaviour has its twin at the same place in every backend:

==================  =========================================================================
``environment``     the device, and the policy that actually runs there (bisect switch, auto)
``layers``          the model's walk: neutral ``Layer`` descriptors and portable kinds
``plan``            the Plan: the core's rules plus what the framework really does per layer
``trace``           the Plan as one forward on example inputs really ran it
``apply``           realising the Plan on the model (``apply`` and what it returns)
``loss_scale``      the loss scaler, reproducing the core's reference trajectory
``monitor``         per-layer numerics, overflow attribution, the run log
``schedule``        precision phases over training
==================  =========================================================================

``common`` holds what they share and is framework-free. The public names are
``ampbridge.torch``, ``ampbridge.keras`` and ``ampbridge.jax``. The verbs every backend exports, their
signatures and rooms are the contract in docs/backends.md (held to the code by
tests/parity/test_contract.py); a backend is found through ``ampbridge.core.registry.BACKENDS``.
"""
