"""Reports the job secret it was given as OUTDIR/<task>.json; then exits, or blocks.

report_secret.py OUTDIR [block]. The report holds KDIST_SECRET_FILE and
KDIST_SECRET as the process sees them, the file's text and mode, its directory's
mode, and the command lines of this process and of its parent (the launcher).
With "block" it prints "ready" and sleeps until it is stopped.
"""

import json
import os
import stat
import sys
import time


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read().decode(errors="replace")


config = os.environ.get("TF_CONFIG")
if config:
    task = json.loads(config)["task"]
    name = f"{task['type']}-{task['index']}"
else:
    name = f"worker-{os.environ['RANK']}"
path = os.environ.get("KDIST_SECRET_FILE")
report = {"KDIST_SECRET_FILE": path, "KDIST_SECRET": os.environ.get("KDIST_SECRET")}
if path and os.path.exists(path):
    with open(path) as file:
        report["text"] = file.read()
    report["file_mode"] = stat.S_IMODE(os.stat(path).st_mode)
    report["dir_mode"] = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
report["cmdline"] = cmdline(os.getpid())
report["parent_cmdline"] = cmdline(os.getppid())
with open(os.path.join(sys.argv[1], f"{name}.json"), "w") as file:
    json.dump(report, file)
if sys.argv[2:] == ["block"]:
    print("ready", flush=True)
    time.sleep(3600)
