"""Prints its launch environment and saves it as OUTDIR/<task name>.json; exits 0."""

import json
import os
import sys

NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "KDIST_LAUNCHER",
    "OMP_NUM_THREADS",
    "PYTHONFAULTHANDLER",
    "PYTHONUNBUFFERED",
)

env = {name: os.environ.get(name) for name in NAMES}
if env["TF_CONFIG"]:
    task = json.loads(env["TF_CONFIG"])["task"]
    name = f"{task['type']}-{task['index']}"
else:
    name = f"worker-{env['RANK']}"
env["argv"] = sys.argv[2:]
with open(os.path.join(sys.argv[1], f"{name}.json"), "w") as file:
    json.dump(env, file)
print(f"hello from {name} on stdout")
print(f"hello from {name} on stderr", file=sys.stderr)
