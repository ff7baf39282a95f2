"""Reads TensorBoard log directories back with tensorboard's own reader and prints them as JSON.

A separate process, because tensorboard's reader imports TensorFlow when it is
installed; the test process stays free of it. Usage:
`tensorboard_read.py OUT.json LOG_DIR [LOG_DIR ...]`. The JSON maps each log
dir to `{run: {"files": [...], "tags": {tag: {"plugin", "steps", "values"}}}}`:
scalars as floats, histograms as `[[left, right, count], ...]`, strings as text.
"""

import json
import os
import sys

from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.util import tensor_util


def read_run(path):
    accumulator = plugin_event_accumulator.EventAccumulator(path, size_guidance={"tensors": 0})
    accumulator.Reload()
    tags = {}
    for tag in sorted(accumulator.Tags()["tensors"]):
        plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
        events = accumulator.Tensors(tag)
        values = []
        for event in events:
            array = tensor_util.make_ndarray(event.tensor_proto)
            if array.dtype.kind in "SO":
                values.append([item.decode("utf-8") for item in array.reshape(-1)])
            else:
                values.append(array.astype(float).tolist())
        tags[tag] = {"plugin": plugin, "steps": [event.step for event in events], "values": values}
    files = sorted(name for name in os.listdir(path) if "tfevents" in name)
    return {"files": files, "tags": tags}


def main():
    out, *log_dirs = sys.argv[1:]
    result = {}
    for log_dir in log_dirs:
        runs = sorted(name for name in os.listdir(log_dir) if os.path.isdir(os.path.join(log_dir, name)))
        result[log_dir] = {run: read_run(os.path.join(log_dir, run)) for run in runs}
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
