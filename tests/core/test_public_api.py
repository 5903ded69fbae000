import doctest
import importlib

import pytest

import ampbridge

CORE_MODULES = ["ampbridge", "ampbridge.errors", "ampbridge.core.dtypes", "ampbridge.core.matching", "ampbridge.core.policy", "ampbridge.core.fields",
                "ampbridge.core.io", "ampbridge.core.loss_scale", "ampbridge.core.plan", "ampbridge.core.schema", "ampbridge.core.table",
                "ampbridge.core.registry", "ampbridge._testing", "ampbridge.cli.commands", "ampbridge.cli.common", "ampbridge.backends.common", "ampbridge.backends.private_hooks", "ampbridge.diagnostics.hardware", "ampbridge.diagnostics.environment",
                "ampbridge.diagnostics.runlog", "ampbridge.diagnostics.report", "ampbridge.diagnostics.doctor", "ampbridge.cli.demo.run",
                "ampbridge.diagnostics.tune", "ampbridge.cli.tune"]


def test_every_public_name_exists():
    for name in ampbridge.__all__:
        assert hasattr(ampbridge, name), name
    assert issubclass(ampbridge.PolicyError, ValueError)
    assert issubclass(ampbridge.BackendUnavailableError, ImportError)
    assert issubclass(ampbridge.PolicyError, ampbridge.AmpBridgeError)


@pytest.mark.parametrize("name", CORE_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if name not in ("ampbridge._testing",):
        assert module.__doc__, f"{name} needs a module docstring"


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ampbridge.nope  # noqa: B018
