"""One task of an asynchronous parameter-server job (the test starts the servers).

Every worker trains the same model on its own shard of the data with
`ParameterServerStrategy` and writes `<out>/worker-<i>.json`: how many steps
it pushed and its loss per epoch.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import kdist  # noqa: E402
from tests.keras import _models  # noqa: E402

EPOCHS = 3
BATCH = 16
NUM_SAMPLES = 960


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    resolver = kdist.cluster.TFConfigClusterResolver()
    num_workers = resolver.cluster_spec().num_tasks("worker")
    strategy = kdist.ParameterServerStrategy(resolver)
    x, y = _models.classification_data(NUM_SAMPLES)
    x, y = x[resolver.task_id :: num_workers], y[resolver.task_id :: num_workers]
    model = _models.build_in_scope(_models.mlp_dropout_batchnorm, strategy)
    _models.seeded(100 + resolver.task_id)  # each worker shuffles its own way
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    result = {"steps": EPOCHS * math.ceil(len(x) / BATCH), "loss": history.history["loss"]}
    Path(args.out, f"worker-{resolver.task_id}.json").write_text(json.dumps(result))
    print(f"worker {resolver.task_id} done: {result}")


if __name__ == "__main__":
    main(sys.argv[1:])
