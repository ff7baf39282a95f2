"""Keras integration: hooks that make `fit`/`evaluate`/`predict` honour a strategy."""
