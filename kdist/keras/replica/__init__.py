"""Synchronous training with Keras: the replica engine and what it needs.

Used by `MirroredStrategy` and `MultiWorkerMirroredStrategy` through their
adapter (`adapter.ReplicaAdapter`). Never imports `kdist.keras.parameter_server`.
See docs/architecture.md.
"""
