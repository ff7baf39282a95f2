"""What the two sides of the variable service agree on besides the proto: names and canonical forms.

A worker and a server must compute these the same way, so neither side owns
them:

- `canonical_config`: the optimizer config a client sends and a server
  compares (sorted JSON, default names dropped, the sparse-update mode checked);
- `CONFIG_KEY` / `check_sparse_updates`: the optimizer config's sparse-update
  mode (`kdist.ps.server.row_updates` applies it);
- `slot_name`: the name of an optimizer slot, unique per variable, on the
  servers (`kdist.ps.server.optimizer_host`) and on the workers
  (`kdist.keras.parameter_server.worker_steps`);
- `initializer_config`: the Keras initializer a creating process sends so a
  server computes a table's first value itself (`kdist.ps.server.server_init`).
"""

import json

import keras

from kdist.errors import InvalidArgumentError

SPARSE_UPDATES = ("exact", "lazy")
# Top-level key of the optimizer config the router sends (next to "class_name");
# absent means "exact", so configs of the default mode stay unchanged.
CONFIG_KEY = "sparse_updates"


def check_sparse_updates(value, argument="sparse_updates"):
    """Returns `value` if it is one of `SPARSE_UPDATES`.

    Raises:
        kdist.errors.InvalidArgumentError: naming `argument`, the value and the choices.
    """
    if not isinstance(value, str) or value not in SPARSE_UPDATES:
        raise InvalidArgumentError(
            f"{argument} must be one of {list(SPARSE_UPDATES)}. Received: {argument}={value!r}. "
            "Use 'exact' (the default: the same numbers as one device) or 'lazy' (touched "
            "rows only, TensorFlow Addons' LazyAdam semantics)."
        )
    return value


def canonical_config(config):
    """Returns the optimizer config as canonical JSON (sorted keys) for comparisons.

    The optimizer's `name` is dropped: Keras numbers default names ("sgd_3"),
    so two workers' identical optimizers differ only there, and the name does
    not change an update.

    Raises:
        kdist.errors.InvalidArgumentError: `config` is not a JSON-able dict.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except (ValueError, RecursionError) as error:
            raise InvalidArgumentError(
                f"The optimizer config is not valid JSON: {error}. Expected the JSON of "
                "keras.optimizers.serialize(optimizer)."
            ) from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(
            "The optimizer config must be the dict keras.optimizers.serialize(optimizer) "
            f"returns. Received: {type(config).__name__}."
        )
    if isinstance(config.get("config"), dict):
        config = {**config, "config": {key: value for key, value in config["config"].items()
                                       if key != "name"}}
    if CONFIG_KEY in config:
        check_sparse_updates(config[CONFIG_KEY], f"The optimizer config's {CONFIG_KEY!r}")
        if config[CONFIG_KEY] == "exact":  # the default: one canonical form
            config = {key: value for key, value in config.items() if key != CONFIG_KEY}
    try:
        return json.dumps(config, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidArgumentError(
            f"The optimizer config is not JSON-able: {error}. Pass "
            "keras.optimizers.serialize(optimizer) of an optimizer whose learning rate "
            "schedule and arguments serialize."
        ) from None


def slot_name(name, taken):
    """The name a slot of one variable is known by, on the servers and on the workers.

    Args:
        name: the short name Keras was given (`add_variable_from_reference`'s
            `name`: "momentum", "velocity"; None is Keras' "var").
        taken: the names already given to the same variable's slots, in
            creation order.

    Returns:
        `name`, or `name_1`, `name_2`, ... when the variable already has a slot
        of that name: unique per (variable, slot).

    Example:

    >>> slot_name("accumulator", ["accumulator"])
    'accumulator_1'
    >>> slot_name(None, [])
    'var'
    """
    name = name or "var"
    candidate, suffix = name, 1
    while candidate in taken:
        candidate, suffix = f"{name}_{suffix}", suffix + 1
    return candidate


def initializer_config(initializer):
    """The JSON a server needs to recompute `initializer`'s value, or None when it cannot.

    None for anything but a built-in Keras initializer, and for one seeded
    with a `keras.random.SeedGenerator` (its draws depend on the creating
    process's generator state).
    """
    if not isinstance(initializer, keras.initializers.Initializer):
        return None
    config = keras.initializers.serialize(initializer)
    if not isinstance(config, dict) or config.get("module") != "keras.initializers" or config.get("registered_name"):
        return None
    seed = getattr(initializer, "seed", None)
    if isinstance(seed, keras.random.SeedGenerator):
        return None
    if "seed" in config.get("config", {}):
        # The seed Keras drew when the initializer was built, not the None in its config.
        config["config"]["seed"] = seed
    try:
        return json.dumps(config)
    except (TypeError, ValueError):
        return None
