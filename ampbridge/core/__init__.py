"""The framework-free core: the policy model and its files, layer matching, the Plan, and the
reference loss-scale algorithm every backend reproduces. It imports the standard library only.

Modules: ``dtypes`` (names, aliases, format facts), ``fields`` (each policy key's checks),
``policy`` (the frozen Policy, Rule, Phase and LossScaleConfig), ``io`` (reading and writing
policy files, presets), ``matching`` (path globs, regexes, kinds), ``plan`` (layers to Plan rows),
``loss_scale`` (the reference algorithm), ``registry`` (which backend owns a model), ``schema``
(the file's JSON Schema), ``table`` (plain-text tables).
"""
