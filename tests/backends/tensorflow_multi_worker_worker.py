"""One task of a TensorFlow-backend `kdist.MultiWorkerMirroredStrategy` job, or its single-process reference.

Run under `KERAS_BACKEND=tensorflow`:

- with a `TF_CONFIG` naming this task: `kdist.MultiWorkerMirroredStrategy()`
  (tf.distribute's, with kdist's resolver and API) trains on the global
  batches; every task passes the same arrays and the same global `batch_size`;
- with `--reference`: plain single-device Keras on the same global batches.

Each prints `RESULT {...}`: the weights after `fit`, the History and the
strategy facts (replicas, this task's input pipeline), for the test to compare.
"""

import argparse
import json
import sys

import kdist  # noqa: E402  (first: it settles the backend)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    args = parser.parse_args()
    # First thing: TensorFlow's collectives are configured before any computation.
    strategy = None if args.reference else kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=60))

    import keras
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.standard_normal((128, 8)).astype("float32")
    y = (x[:, 0] - x[:, 1] > 0).astype("int64")

    def build():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if strategy is None:
        model = build()
        facts = {}
    else:
        with strategy.scope():
            model = build()
        facts = {"num_replicas_in_sync": strategy.num_replicas_in_sync,
                 "input_pipeline_id": strategy.extended.input_pipeline_id,
                 "is_kdist": type(strategy).__module__}
    history = model.fit(x, y, batch_size=args.batch_size, epochs=2, shuffle=False, verbose=0)
    result = {"weights": [weight.tolist() for weight in model.get_weights()],
              "loss": history.history["loss"], **facts}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
