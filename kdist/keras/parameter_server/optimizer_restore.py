"""`model.load_weights` under `ParameterServerStrategy`: what it loads reaches the servers.

The servers apply every update with their own optimizer, so a backup's
optimizer state (iterations and slots, which `BackupAndRestore` and
`ModelCheckpoint(save_weights_only=True)` files hold) must be sent to them
with the weights, or the run after a restore would start from the servers'
old slots: silently different from one device.

`load_weights` is one unit of `kdist.keras.parameter_server.variable_writes`:
every variable Keras assigns while loading (weights, tables, the optimizer's
slots and iterations when the file held optimizer state) is sent when the
call returns, and nothing when it fails. Only what Keras loaded is sent, as
plain Keras changes only that: a file of model weights only leaves the
servers' optimizer as it was. A partitioned variable's slots are split by the
current partitioning, so a backup restores on any number of servers
(`optimizer_states.split`).
"""

import contextlib


@contextlib.contextmanager
def sending_loaded_state(session, optimizer):
    """Around `load_weights`: afterwards, sends what it loaded (weights and optimizer state).

    Args:
        session: the model's `PSSession` (unused: every write finds its servers).
        optimizer: the model's optimizer, or None (unused, likewise).
    """
    # Imported here: worker_steps imports this module, and variable_writes imports worker_steps.
    from kdist.keras.parameter_server import variable_writes

    del session, optimizer
    with variable_writes.writing("model.load_weights()"):
        yield
