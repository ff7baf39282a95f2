"""Pins every Keras internal kdist uses, so an upgrade that moves one fails loudly here."""

import pytest

from kdist.keras import _compat


@pytest.mark.parametrize("name", sorted(_compat.PINNED_INTERNALS))
def test_keras_internal_is_still_there(name):
    try:
        _compat.PINNED_INTERNALS[name]()
    except (AttributeError, ImportError) as error:
        pytest.fail(f"Keras internal '{name}' used by kdist/keras/_compat.py moved: {error}")


def test_only_compat_imports_keras_internals():
    import pathlib
    import re

    package = pathlib.Path(_compat.__file__).parents[1]
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "_compat.py"
        and re.search(r"^\s*(from|import)\s+keras\.src", path.read_text(), re.MULTILINE)
    ]
    assert offenders == []
