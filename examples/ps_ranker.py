"""Train a DCN or DLRM ranker built from `keras_rs.layers` on parameter servers, embedding tables partitioned.

One script for every task of the cluster, as keras-rs's DCN and DLRM examples build
their rankers (`keras_rs.layers.FeatureCross`, `keras_rs.layers.DotInteraction`):

    kdist launch --ps 2 --workers 2 examples/ps_ranker.py --small
    kdist launch --ps 2 --workers 1 examples/ps_ranker.py --small --out w.npz   # equals --plain
    python examples/ps_ranker.py --small --plain --out plain.npz                # plain Keras, one device

Each categorical feature (user, item, category ids) has its own `Embedding` table,
created in `strategy.scope()` on the parameter servers and split by rows over all
of them (`kdist.partitioners.FixedShardsPartitioner`); a step pulls and pushes only
the rows its batch touches. Workers train asynchronously, each on its own shard of
the click log; the servers apply Adagrad. With one worker the steps run one after
another, so the result equals plain Keras on the same batches
(`tests/examples/test_ps_ranker.py` checks it). Prints one JSON line (the chief).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import keras_rs  # noqa: E402
import numpy as np  # noqa: E402

SEED = 11
VOCABULARIES = {"user": 2000, "item": 5000, "category": 50}
DENSE_FEATURES = 6
EMBEDDING_DIM = 8


def make_clicks(num_samples, seed=0):
    """A synthetic click log: ids per feature (Zipf-like), dense features, and a click label."""
    rng = np.random.default_rng(seed)
    features = {name: (rng.zipf(1.3, size=(num_samples, 1)) % size).astype("int64")
                for name, size in VOCABULARIES.items()}
    features["dense"] = rng.normal(size=(num_samples, DENSE_FEATURES)).astype("float32")
    score = (np.sin(features["user"][:, 0] * 0.7) + np.cos(features["item"][:, 0] * 0.3)
             + features["dense"][:, 0] - 0.5 * (features["category"][:, 0] % 3))
    labels = (score + rng.normal(scale=0.5, size=num_samples) > 0.5).astype("float32")
    return features, labels


def build_ranker(kind):
    """DCN (cross layers over the concatenated embeddings) or DLRM (dot interactions), as keras-rs builds them."""
    inputs = {name: keras.Input((1,), dtype="int64", name=name) for name in VOCABULARIES}
    inputs["dense"] = keras.Input((DENSE_FEATURES,), name="dense")
    embeddings = [keras.layers.Reshape((EMBEDDING_DIM,))(
        keras.layers.Embedding(size, EMBEDDING_DIM, name=f"{name}_table")(inputs[name]))
        for name, size in VOCABULARIES.items()]
    bottom = keras.layers.Dense(EMBEDDING_DIM, activation="relu", name="bottom")(inputs["dense"])
    if kind == "dcn":
        x0 = keras.layers.Concatenate()([bottom, *embeddings])
        x = x0
        for index in range(2):
            x = keras_rs.layers.FeatureCross(projection_dim=8, name=f"cross_{index}")(x0, x)
    else:
        x = keras.layers.Concatenate()([bottom, keras_rs.layers.DotInteraction(name="interaction")([bottom, *embeddings])])
    x = keras.layers.Dense(16, activation="relu", name="top")(x)
    outputs = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    return keras.Model(inputs, outputs, name=f"{kind}_ranker")


def compile_ranker(model):
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


def train(args, strategy=None, worker=0, num_workers=1):
    """Builds the ranker in `strategy`'s scope (plain Keras when None) and fits it on this worker's shard."""
    keras.utils.set_random_seed(SEED)
    features, labels = make_clicks(args.samples, seed=1)
    shard = {name: value[worker::num_workers] for name, value in features.items()}
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = compile_ranker(build_ranker(args.model))
    history = model.fit(shard, labels[worker::num_workers], batch_size=args.batch_size, epochs=args.epochs,
                        shuffle=False, verbose=args.verbose)
    return model, history.history


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["dcn", "dlrm"], default="dcn")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=128, help="batch size of EACH worker")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--plain", action="store_true", help="plain Keras in this process (the reference)")
    parser.add_argument("--out", default=None, help="the chief saves the final weights to this .npz file")
    parser.add_argument("--small", action="store_true", help="CI size: 2000 samples, 2 epochs")
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)
    if args.small:
        args.samples, args.epochs = min(args.samples, 2000), min(args.epochs, 2)
    return args


def report(args, model, history, extra):
    if args.out:
        np.savez(args.out, *[np.asarray(w) for w in model.get_weights()])
    print(json.dumps({"example": "ps_ranker", "model": args.model, "final_loss": history["loss"][-1],
                      "final_auc": history["auc"][-1], **extra}), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.plain:
        model, history = train(args)
        report(args, model, history, {"num_workers": 0})
        return 0
    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type == "ps":
        server = kdist.distribute.Server(resolver.cluster_spec(), "ps", resolver.task_id)
        server.start()
        server.join()
        return 0
    num_ps = resolver.cluster_spec().num_tasks("ps")
    num_workers = resolver.cluster_spec().num_tasks("worker")
    # Every table is split by rows over all parameter servers; small dense variables stay whole.
    strategy = kdist.ParameterServerStrategy(
        resolver, variable_partitioner=kdist.partitioners.FixedShardsPartitioner(num_shards=num_ps))
    model, history = train(args, strategy, resolver.task_id, num_workers)
    if strategy.extended.should_checkpoint:
        stats = strategy.extended.variable_router.stats()
        report(args, model, history, {"num_workers": num_workers, "num_ps": num_ps,
                                      "rows_updated": [sum(v.rows_updated for v in s.variables.values())
                                                       for s in stats]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
