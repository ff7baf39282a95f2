"""Server-side update rules: one Keras optimizer per variable.

The coordinator sends `keras.optimizers.serialize(optimizer)`; the server
rebuilds it with `keras.optimizers.deserialize`, one instance per variable, so
that the variable's lock is the only lock an update needs and the optimizer's
slots live next to their variable. `optimizer.apply([gradient], [variable])`
then runs exactly the code single-device Keras runs.

Slots are recorded by wrapping `add_variable_from_reference` on the instance:
Keras calls it once per slot with the slot's name ("momentum", "velocity",
...), in a fixed order. A slot is known by `slot_name`: its short name, made
unique among the same variable's slots. The worker's optimizer wrapper
(`kdist.keras.parameter_server.worker_steps`) names its local slots with the
same function, so each slot the server reports (`optimizer_state`, a
checkpoint) finds its local twin even when one variable has two slots of the
same short name.

Row gradients go through `apply_rows`: to the touched rows only where that is
exact or opted into (`kdist.ps.server.row_updates`), else as Keras' dense update.
"""

import json

import keras

from kdist.errors import InvalidArgumentError
from kdist.ps.server import memory
from kdist.ps.server.row_updates import RowUpdates, sparse_refusal
from kdist.ps.wire.conventions import CONFIG_KEY, slot_name
from kdist.rpc import dtypes
from kdist.validation import is_integer


def deserialize_optimizer(config_json):
    """Builds a fresh optimizer instance from canonical config JSON (its `sparse_updates` aside).

    Raises:
        kdist.errors.InvalidArgumentError: Keras cannot rebuild it, it is not
            an optimizer, or it uses `global_clipnorm`, which needs every
            gradient of a step at once (updates here are per variable).
    """
    config = {key: value for key, value in json.loads(config_json).items() if key != CONFIG_KEY}
    try:
        optimizer = keras.optimizers.deserialize(config)
    except Exception as error:  # Keras raises many types for bad configs.
        raise InvalidArgumentError(
            f"keras.optimizers.deserialize cannot rebuild the optimizer config: "
            f"{type(error).__name__}: {error}. Received: config={config_json[:200]}."
        ) from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"The config does not describe a Keras optimizer. Received: "
            f"{type(optimizer).__name__}."
        )
    if getattr(optimizer, "global_clipnorm", None):
        raise InvalidArgumentError(
            "global_clipnorm needs every gradient of a step at once, but a parameter "
            "server applies updates per variable. Received: global_clipnorm="
            f"{optimizer.global_clipnorm}. Use clipnorm (per variable) or clip on the worker."
        )
    return optimizer


class VariableOptimizer:
    """One Keras optimizer built on one variable.

    Not thread-safe: the owner holds the variable's lock around every call.

    Args:
        config_json: canonical JSON of `keras.optimizers.serialize(optimizer)`,
            with an optional top-level `"sparse_updates": "lazy"`.
        variable: the server's `keras.Variable`.

    Raises:
        kdist.errors.InvalidArgumentError: see `deserialize_optimizer`, or
            `sparse_updates="lazy"` with an optimizer that cannot run on
            gathered rows.

    Example:

    >>> host = VariableOptimizer(canonical_config(keras.optimizers.serialize(
    ...     keras.optimizers.SGD(0.1))), keras.Variable([1.0]))  # doctest: +SKIP
    """

    def __init__(self, config_json, variable):
        self.config_json = config_json
        self.variable = variable
        self.optimizer = deserialize_optimizer(config_json)
        self.slot_names = []
        self.slots = []
        original = self.optimizer.add_variable_from_reference

        def record_slot(reference_variable, name=None, *args, **kwargs):
            slot = original(reference_variable, name, *args, **kwargs)
            self.slot_names.append(slot_name(name, self.slot_names))
            self.slots.append(slot)
            return slot

        self.optimizer.add_variable_from_reference = record_slot
        with keras.device("cpu"):
            self.optimizer.build([variable])
        for slot in self.slots:  # a table's slots are read by rows like the table
            memory.move_variable(slot)
        self.sparse_updates = json.loads(config_json).get(CONFIG_KEY, "exact")
        refusal = sparse_refusal(self.optimizer, variable, self.slots, self.sparse_updates)
        if refusal and self.sparse_updates == "lazy":
            raise InvalidArgumentError(
                f"sparse_updates='lazy' cannot apply {type(self.optimizer).__name__} to the "
                f"touched rows of {variable.name!r}: {refusal}. Received: config="
                f"{config_json[:200]}. Use sparse_updates='exact' (Keras' dense update) or "
                "one of SGD, Adagrad, Adam, AdamW, RMSprop without EMA or accumulation."
            )
        builtin = type(self.optimizer).__module__.startswith("keras.")
        self.rows = RowUpdates(self, sparse=refusal is None, builtin=builtin)

    @property
    def handles_non_finite_gradients(self):
        """True for a `LossScaleOptimizer`: it skips a step with NaN or infinite gradients
        and lowers its loss scale, so it must see them."""
        return isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)

    def apply(self, gradient):
        """Applies the torch `gradient` (shaped like the variable) to the variable."""
        with keras.device("cpu"):
            self.optimizer.apply([gradient], [self.variable])

    def apply_rows(self, ids, rows):
        """Applies the row gradient `(ids, rows)` (NumPy; ids int64 and in range).

        Returns:
            `(sparse, num_rows)`: whether only the touched rows were updated,
            and how many distinct rows the gradient touched.
        """
        with keras.device("cpu"):
            return self.rows.sparse, self.rows.apply(ids, rows)

    @property
    def iterations(self):
        """Updates applied so far (the optimizer's `iterations`)."""
        return int(self.optimizer.iterations.numpy())

    def state(self):
        """Returns `(iterations, [(slot name, NumPy copy)])` in creation order."""
        return self.iterations, [
            (name, dtypes.to_numpy(slot.value).copy())
            for name, slot in zip(self.slot_names, self.slots)
        ]

    def load_state(self, iterations, slots):
        """Sets iterations and slot values (a dict name -> array, every slot present).

        Raises:
            kdist.errors.InvalidArgumentError: as `check_state`; nothing changes then.
        """
        self.check_state(iterations, slots)
        self.optimizer.iterations.assign(iterations)
        for name, slot in zip(self.slot_names, self.slots):
            slot.assign(dtypes.to_torch(slots[name]))

    def check_state(self, iterations, slots):
        """Checks what `load_state` would load, changing nothing.

        Raises:
            kdist.errors.InvalidArgumentError: negative iterations, or a slot
                missing, unknown, or of the wrong shape or dtype.
        """
        if not is_integer(iterations, minimum=0):
            raise InvalidArgumentError(
                f"The iterations of {self.variable.name!r}'s optimizer must be an integer "
                f">= 0. Received: {iterations!r}."
            )
        if list(slots) != self.slot_names:
            raise InvalidArgumentError(
                f"The optimizer of {self.variable.name!r} has slots {self.slot_names}. "
                f"Received: {list(slots)}."
            )
        for name, slot in zip(self.slot_names, self.slots):
            value = slots[name]
            expected = (tuple(slot.shape), dtypes.to_numpy(slot.value).dtype)
            if (value.shape, value.dtype) != expected:
                raise InvalidArgumentError(
                    f"Slot {name!r} must have shape {expected[0]} and dtype {expected[1]}. "
                    f"Received: shape={value.shape}, dtype={value.dtype}."
                )


def config_differences(old_json, new_json):
    """Returns `{key: (old, new)}` for the optimizer arguments that differ."""
    old, new = json.loads(old_json), json.loads(new_json)
    old_arguments = {"class_name": old.get("class_name"), CONFIG_KEY: old.get(CONFIG_KEY, "exact"),
                     **(old.get("config") or {})}
    new_arguments = {"class_name": new.get("class_name"), CONFIG_KEY: new.get(CONFIG_KEY, "exact"),
                     **(new.get("config") or {})}
    return {
        key: (old_arguments.get(key), new_arguments.get(key))
        for key in sorted(set(old_arguments) | set(new_arguments))
        if old_arguments.get(key) != new_arguments.get(key)
    }
