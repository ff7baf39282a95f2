"""Runs fit, evaluate and predict under a kdist strategy in a process where
`torch.distributed` is initialized, and records whether Keras (>= 3.16) wrapped
the model in `DistributedDataParallel` after each (`<out>/rank<r>.json`).

`--strategy multi_worker` uses `MultiWorkerMirroredStrategy` (which initializes
the process group); `--strategy mirrored` initializes it by hand, as a program
started by torchrun that uses a one-process strategy would.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kdist  # noqa: E402
from kdist import faults  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", choices=["multi_worker", "mirrored"], required=True)
    parser.add_argument("--allow-wrap", action="store_true", help="negative control")
    args = parser.parse_args()
    if args.allow_wrap:
        faults.ACTIVE = faults.FaultInjection(upstream_ddp_wrap=True)
    if args.strategy == "multi_worker":
        strategy = kdist.MultiWorkerMirroredStrategy()
    else:
        torch.distributed.init_process_group("gloo")
        strategy = kdist.MirroredStrategy(["cpu:0"])
    rank = torch.distributed.get_rank()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x, y = np.random.default_rng(0).normal(size=(2, 32, 4)).astype("float32")[0], np.zeros((32, 2), "float32")
    wrapped = {}
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    wrapped["fit"] = getattr(model, "ddp_model", None) is not None
    model.evaluate(x, y, batch_size=8, verbose=0)
    wrapped["evaluate"] = getattr(model, "ddp_model", None) is not None
    model.predict(x, batch_size=8, verbose=0)
    wrapped["predict"] = getattr(model, "ddp_model", None) is not None
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as file:
        json.dump(wrapped, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
