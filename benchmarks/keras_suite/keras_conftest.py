"""Stands in for Keras' repository `conftest.py` (not in the sdist): `from conftest import skip_if_backend`.

`benchmarks/keras_suite/run.py` copies it into the work folder as `conftest.py`.
"""

import pytest
from keras.src.backend import backend


def skip_if_backend(given_backend, reason):
    """As Keras' own: skips the test on `given_backend`."""
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
