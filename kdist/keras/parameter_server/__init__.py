"""Parameter-server training with Keras: worker steps, the chief's `fit`, the worker runtime.

Used by `ParameterServerStrategy` through its adapter
(`adapter.ParameterServerAdapter`), which also decides where each model call
goes. See docs/architecture.md.
"""
