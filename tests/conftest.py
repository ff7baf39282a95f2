"""Test-wide setup: Keras must see the torch backend before any test module imports it."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
