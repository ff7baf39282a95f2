"""One training run with a TensorBoard callback; see tests/keras/test_tensorboard.py.

`--block-tensorflow` makes `tensorflow` and `tensorboard` unimportable before
anything else is imported, the way Python marks a module as missing
(`sys.modules[name] = None`: `import` raises ModuleNotFoundError and
`importlib.util.find_spec` answers None, as for an absent package; a
meta-path finder that raises breaks torch, whose dynamo probes
`find_spec("tensorflow")` at import).

`--writer` picks the callback: `keras` (Keras' own class, which needs
TensorFlow), `kdist` (`kdist.callbacks.TensorBoard`) or `unchanged`
(`keras.callbacks.TensorBoard`, as a user writes it). Prints `pid=<pid>
rank=<rank> class=<module.Class>`. `--early` builds the `unchanged` callback
before kdist is imported (a callback list at the top of a script), so it is
Keras' own class until a kdist model's `fit` receives it; the class printed
is then the one after `fit`.
"""

import sys

if "--block-tensorflow" in sys.argv:
    for _name in ("tensorflow", "tensorboard"):
        sys.modules[_name] = None

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

# Bound before kdist loads, as a user's `from keras.callbacks import TensorBoard` may be.
from keras.callbacks import TensorBoard as KerasTensorBoardName  # noqa: E402


def build_model():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2)], name="sequential"
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--writer", choices=["keras", "kdist", "unchanged"], required=True)
    parser.add_argument("--strategy", choices=["none", "mirrored", "multi_worker"], default="none")
    parser.add_argument("--options", default="{}", help="TensorBoard keyword arguments, as JSON")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--block-tensorflow", action="store_true")
    parser.add_argument("--history", help="write fit's history and evaluate's result here, as JSON")
    parser.add_argument("--early", action="store_true", help="build the callback before importing kdist")
    args = parser.parse_args()
    options = json.loads(args.options)
    early = KerasTensorBoardName(args.log_dir, **options) if args.early else None
    if early is not None:
        print(f"before kdist: class={type(early).__module__}.{type(early).__name__}", flush=True)

    import kdist

    seeding.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((40, 4), dtype=np.float32)
    y = (rng.random(40) > 0.5).astype("int32")
    rank = 0
    if args.strategy == "mirrored":
        strategy = kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    elif args.strategy == "multi_worker":
        strategy = kdist.MultiWorkerMirroredStrategy(
            communication_options=kdist.CommunicationOptions(timeout_seconds=60)
        )
        rank = strategy.extended.collectives.rank
    else:
        strategy = kdist.get_strategy()  # the default strategy: plain Keras (and loads kdist)
    with strategy.scope():
        model = build_model()
    if early is not None:
        callback = early
    elif args.writer == "kdist":
        callback = kdist.callbacks.TensorBoard(args.log_dir, **options)
    else:
        # The user's unchanged Keras name: Keras' own class where TensorFlow works, kdist's otherwise.
        callback = KerasTensorBoardName(args.log_dir, **options)
    history = model.fit(x, y, batch_size=8, epochs=args.epochs, validation_split=0.25, callbacks=[callback], verbose=0)
    print(f"pid={os.getpid()} rank={rank} class={type(callback).__module__}.{type(callback).__name__}", flush=True)
    evaluation = model.evaluate(x, y, batch_size=8, callbacks=[callback], verbose=0, return_dict=True)
    if args.history and rank == 0:
        with open(args.history, "w") as file:
            json.dump({"history": history.history, "evaluate": evaluation}, file)
    print("done", sorted(os.listdir(args.log_dir)) if os.path.isdir(args.log_dir) else None, flush=True)


if __name__ == "__main__":
    main()
