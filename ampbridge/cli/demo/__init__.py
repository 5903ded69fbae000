"""``ampbridge demo`` and the conformance model (``model``, ``torch_model``, ``keras_model``,
``flax_model``). Nothing here is imported by ``import ampbridge``."""
