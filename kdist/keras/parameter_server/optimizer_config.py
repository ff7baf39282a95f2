"""The optimizer config the parameter servers rebuild: the worker-side settings switched off."""

import keras

from kdist.errors import UnsupportedError

# Optimizer settings the worker applies itself before pushing (they need the
# whole gradient, or the worker's loss scale); the servers get them switched off.
_WORKER_SIDE_SETTINGS = ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")


def server_optimizer_config(optimizer):
    """`keras.optimizers.serialize(optimizer)` with the worker-side settings switched off.

    Raises:
        kdist.errors.UnsupportedError: gradient accumulation, EMA or a
            `LossScaleOptimizer`, which need state the servers do not share.
    """
    if getattr(optimizer, "gradient_accumulation_steps", None) or getattr(optimizer, "use_ema", False):
        raise UnsupportedError(
            "gradient_accumulation_steps and use_ema are not supported under "
            "ParameterServerStrategy: the servers apply each push at once and keep no "
            f"averages. Received: optimizer {optimizer.name!r} with "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps!r}, "
            f"use_ema={optimizer.use_ema!r}. Remove those settings."
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise UnsupportedError(
            "LossScaleOptimizer is not supported under ParameterServerStrategy. Received: "
            f"optimizer {optimizer.name!r}. Keep variables in float32 and use a plain optimizer."
        )
    config = keras.optimizers.serialize(optimizer)
    for key in _WORKER_SIDE_SETTINGS:
        if key in config["config"]:
            config["config"][key] = None
    return config
