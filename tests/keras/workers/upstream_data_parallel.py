"""A Keras 3.16 user's own multi-process `keras.distribution.DataParallel` program on
torch, with kdist installed but not used. Each rank writes what the program
produced to `<out>/rank<r>.npz`.

`--mode plain` never imports kdist (and checks it stayed out of `sys.modules`).
`--mode hooks` imports kdist and loads its whole public surface, which installs
its hooks on Keras' classes, as a program that imports a library using kdist
would; it never creates a strategy. `--mode kdist-unwraps` is the negative
control: it applies kdist's "keep out of Keras' DDP" to the user's model, as a
hook that leaked onto models kdist does not own would.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["plain", "hooks", "kdist-unwraps"], required=True)
    args = parser.parse_args()
    if args.mode != "plain":
        import kdist

        # Any public name loads the surface: Keras' Trainer, optimizers, variables
        # and epoch iterator are now hooked in this process.
        assert kdist.MirroredStrategy is not None
        from kdist.keras import hooks

        assert hooks._installed

    keras.distribution.initialize()
    rank = torch.distributed.get_rank()
    distribution = keras.distribution.DataParallel()
    # The arrays below are this rank's shard already (Keras' documented switch).
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    seeding.set_random_seed(7)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(2),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if args.mode == "kdist-unwraps":
        from kdist.keras import _compat

        _compat.keep_out_of_upstream_ddp(model)
    # Each rank reads its own half of every epoch, as a sharded input pipeline would.
    x_rank, y_rank = x[rank::2], y[rank::2]
    history = model.fit(x_rank, y_rank, batch_size=8, epochs=3, shuffle=True, verbose=0)
    wrapped = getattr(model, "ddp_model", None) is not None
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    prediction = model.predict(x, batch_size=16, verbose=0)
    if args.mode == "plain":
        assert "kdist" not in sys.modules, "the plain program must not import kdist"
    arrays = {f"weight/{i}": v.numpy() for i, v in enumerate(model.weights)}
    arrays.update({f"slot/{i}": np.asarray(v.numpy()) for i, v in enumerate(model.optimizer.variables)})
    arrays.update({f"history/{k}": np.asarray(v) for k, v in history.history.items()})
    arrays.update({f"evaluate/{k}": np.asarray(v) for k, v in evaluation.items()})
    arrays["predict"] = prediction
    arrays["wrapped"] = np.asarray(wrapped)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **arrays)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
