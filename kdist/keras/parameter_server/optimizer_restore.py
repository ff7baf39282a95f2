"""`model.load_weights` under `ParameterServerStrategy`: the loaded optimizer state reaches the servers.

The servers apply every update with their own optimizer, so a backup's
optimizer state (iterations and slots, which `BackupAndRestore` and
`ModelCheckpoint(save_weights_only=True)` files hold) must be sent to them
after Keras loaded it into the local optimizer, or the run after a restore
would start from the servers' old slots: silently different from one device.

Only when the file held optimizer state (Keras called the optimizer's
`load_own_variables`) is it sent, as plain Keras then changes the optimizer;
a file of model weights only leaves the servers' optimizer as it was. A
partitioned variable's slots are split by the current partitioning, so a
backup restores on any number of servers (`optimizer_states.split`).
"""

import contextlib

import keras


@contextlib.contextmanager
def sending_loaded_state(session, optimizer):
    """Around `load_weights`: afterwards, sends the optimizer state it loaded, if any."""
    if optimizer is None or not hasattr(optimizer, "_kdist_ps_slots"):
        yield
        return
    loaded = []
    had_own = "load_own_variables" in vars(optimizer)
    original = optimizer.load_own_variables

    def load_own_variables(store):
        result = original(store)
        loaded.append(True)
        return result

    object.__setattr__(optimizer, "load_own_variables", load_own_variables)
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(optimizer, "load_own_variables", original)
        else:
            object.__delattr__(optimizer, "load_own_variables")
    if loaded:
        send_state(session, optimizer)


def send_state(session, optimizer):
    """Makes the servers' optimizer state of the model's trainable variables the local one."""
    routes = [route for route in session.routes() if route.trainable]
    if not routes:
        return
    session.configure(optimizer, routes)
    names, slots = optimizer._kdist_ps_slot_names, optimizer._kdist_ps_slots
    iterations = int(keras.ops.convert_to_numpy(optimizer.iterations.value))
    states = []
    for route in routes:
        key = id(route.variable)
        states.append((iterations, {
            name: keras.ops.convert_to_numpy(slots[(key, name)].value) for name in names.get(key, ())
        }))
    session.router.load_optimizer_state(routes, states)
