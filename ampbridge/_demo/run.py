"""``ampbridge demo``: the example policy, resolved and planned.

Until the framework backends land, the demo shows what the core alone can: the policy
resolved with its defaults (``ampbridge show``) and its Plan for the demo model's layers
(``ampbridge explain --layers``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import _io
from .._plan import build_plan, layers_from_data

EXAMPLES = Path(__file__).parent.parent / "examples"


def run_demo(args: argparse.Namespace) -> int:
    from .._cli import _defaults_notes

    path = Path(args.policy) if args.policy else EXAMPLES / "amp.toml"
    policy, origins = _io.load_with_origins(path)
    print(f"== ampbridge show {path.name}")
    print(_io.render(_io.policy_to_dict(policy), "toml", _defaults_notes(policy, origins, str(path))))
    layers = layers_from_data(json.loads((EXAMPLES / "layers.json").read_text()), "layers.json")
    print(f"== ampbridge explain {path.name} --layers layers.json")
    print(build_plan(layers, policy, warn=False).table())
    return 0
