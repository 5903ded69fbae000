"""The JSON Schema of the policy file, built from the same field table the loader checks with.

The schema describes the file's shape (keys, types, ranges, enums); the loader's checks go
further (patterns must compile, phases must be ordered, min_scale <= max_scale).

Example:
    >>> from ampbridge.core.schema import json_schema
    >>> json_schema()["properties"]["loss_scale"]["properties"]["mode"]["default"]
    'auto'
"""

from __future__ import annotations

from typing import Any

from .fields import FP8_FIELDS, LOSS_SCALE_FIELDS, PHASE_BOUNDS, RULE_FIELDS, TOP_FIELDS, FieldSpec, kinds_schema

SCHEMA_ID = "https://ampbridge.invalid/schema/policy-v1.json"


def _props(specs: tuple[FieldSpec, ...]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for spec in specs:
        entry = dict(spec.schema)
        entry["description"] = spec.doc
        if spec.default not in (None, ()):
            entry["default"] = spec.default
        elif spec.default == ():
            entry["default"] = []
        props[spec.name] = entry
    return props


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a version-1 policy document."""
    loss_scale = {"type": "object", "additionalProperties": False, "properties": _props(LOSS_SCALE_FIELDS)}
    rule = {"type": "object", "additionalProperties": False, "required": ["match"],
            "properties": _props(RULE_FIELDS),
            "anyOf": [{"required": [k]} for k in ("compute_dtype", "param_dtype", "output_dtype")]}
    fp8 = {"type": "object", "additionalProperties": False, "properties": _props(FP8_FIELDS),
           "description": "float8 matmuls for the matched layers (empty match: off)"}
    settings = _props(TOP_FIELDS)
    phase_props = {k: v for k, v in settings.items() if k != "version"}
    phase_props.update({b: {"type": "integer", "minimum": 1, "description": f"the phase lasts while the "
                            f"{b[6:]} is below this (exclusive)"} for b in PHASE_BOUNDS})
    phase_props["override"] = {"type": "array", "items": rule}
    phase_props["loss_scale"] = {
        "type": "object", "additionalProperties": False,
        "properties": {**_props(LOSS_SCALE_FIELDS),
                       "reset": {"type": "boolean", "description": "restart the loss-scale state"}},
    }
    phase_props["fp8"] = fp8
    phase = {"type": "object", "additionalProperties": False, "properties": phase_props,
             "not": {"required": list(PHASE_BOUNDS)}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "ampbridge mixed-precision policy, version 1",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            **settings,
            "extends": {"type": "string", "minLength": 1,
                        "description": "a preset name or a path relative to this file"},
            "override": {"type": "array", "items": rule,
                         "description": "later rules win over earlier ones and over keep_float32"},
            "loss_scale": loss_scale,
            "fp8": fp8,
            "phase": {"type": "array", "items": phase, "description": "a precision schedule"},
            "kinds": kinds_schema(),
        },
    }
