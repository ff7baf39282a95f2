"""`Embedding` layers whose table lives on parameter servers read only the rows a batch uses.

The layer's `call` is replaced on that instance: it looks the batch's distinct
ids up on the shards that own them (one request per server), builds the
output from those rows (which shard owns which row is
`kdist.distribute.parameter_server.rows`' business, behind
`VariableRouter.lookup`), and — during a training step — records the rows so
their gradients, and nothing else of the table, are sent
(`VariableRouter.send_gradients`). The layer's class
is untouched, so a saved model loads in plain Keras.
"""

import keras
import torch

from kdist.keras import _compat


def enable_row_lookups(model, session, current_step):
    """Makes `Embedding` layers with a remote table read only the rows each batch uses."""
    if len(session.strategy.extended.replica_devices) > 1:
        return  # the replica engine runs layers statelessly; tables are read whole there
    for layer in _compat.sublayers(model):
        if not isinstance(layer, keras.layers.Embedding) or getattr(layer, "_kdist_row_lookup", False):
            continue
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            continue
        entry = session.router.entry(layer.embeddings)
        if entry is None:
            continue
        entry.row_sparse = True
        _override_embedding_call(layer, entry, session.router, current_step)


def _override_embedding_call(layer, entry, router, current_step):
    original_call = layer.call

    def call(inputs):
        ids = inputs if isinstance(inputs, torch.Tensor) else None
        if ids is None or ids.device.type == "meta":
            return original_call(inputs)
        flat = ids.reshape(-1).to(torch.int64)
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows, versions = router.lookup(entry, unique)
        rows = rows.to(entry.variable.value.device)
        step = current_step()
        if step is not None and torch.is_grad_enabled() and layer.trainable:
            rows.requires_grad_(True)
            step.record_rows(entry, unique, rows, versions)
        outputs = rows[inverse].reshape(tuple(ids.shape) + tuple(rows.shape[1:]))
        return keras.ops.cast(outputs, dtype=layer.compute_dtype)

    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, "_kdist_row_lookup", True)
