"""Where the test suite's time goes: per file, per kind of test, and the slowest tests.

Reads the JUnit XML of a pytest run (`python -m pytest -q --junitxml=run.xml`) and
prints one JSON line per group, then the slowest tests. A file's kind is read from
its source, the first that applies:

- `launcher`: it runs `kdist launch` (or torchrun) as a process;
- `subprocess`: it starts processes through `tests/harness.py` or `subprocess`;
- `server`: it starts gRPC servers in the test's own process;
- `in-process`: everything else.

With two XML files (`--before A.xml --after B.xml`), each group gets both times
and the tests that passed in one run and not in the other are listed.

Usage:

    python benchmarks/suite_durations.py --after /tmp/after.xml [--before /tmp/before.xml] [--top 30]
"""

import argparse
import collections
import json
import pathlib
import re
import xml.etree.ElementTree as ElementTree

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
KINDS = (
    ("launcher", re.compile(r'"launch"|torchrun|kdist\.launch\.cli')),
    ("subprocess", re.compile(r"harness\.(run|start|python_specs)|subprocess\.(run|Popen)")),
    ("server", re.compile(r"create_server|in_process_servers|_in_process\.cluster|VariableServer\(")),
)


def kind_of(path):
    """The kind of the test file at `path` (relative to the repository), from its source."""
    try:
        source = (REPOSITORY / path).read_text(encoding="utf-8")
    except OSError:
        return "in-process"
    for kind, pattern in KINDS:
        if pattern.search(source):
            return kind
    return "in-process"


def read(xml_path):
    """`{test id: (seconds, outcome)}` of one JUnit XML file."""
    tests = {}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "")
        path = module.replace(".", "/") + ".py"
        if not (REPOSITORY / path).exists():  # a class inside the module: drop its name
            path = module.rsplit(".", 1)[0].replace(".", "/") + ".py"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = "failed" if tag in ("failure", "error") else "skipped"
        tests[f"{path}::{case.get('name')}"] = (float(case.get("time", 0.0)), outcome)
    return tests


def groups(tests, key):
    totals = collections.defaultdict(lambda: [0.0, 0])
    for test_id, (seconds, _) in tests.items():
        total = totals[key(test_id)]
        total[0] += seconds
        total[1] += 1
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--after", required=True, help="JUnit XML of the run to describe")
    parser.add_argument("--before", help="JUnit XML of an earlier run to compare with")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    runs = {"after": read(args.after)}
    if args.before:
        runs["before"] = read(args.before)

    def file_of(test_id):
        return test_id.split("::", 1)[0]

    def kind(test_id):
        return kind_of(file_of(test_id))

    for name, key in (("kind", kind), ("file", file_of)):
        per_run = {run: groups(tests, key) for run, tests in runs.items()}
        names = sorted(per_run["after"], key=lambda k: -per_run["after"][k][0])
        for group in names:
            line = {"group": name, name: group, "tests": per_run["after"][group][1]}
            for run, totals in per_run.items():
                line[f"seconds_{run}"] = round(totals.get(group, [0.0])[0], 1)
            print(json.dumps(line))
    for run, tests in runs.items():
        outcomes = collections.Counter(outcome for _, outcome in tests.values())
        print(json.dumps({"run": run, "seconds": round(sum(s for s, _ in tests.values()), 1), **outcomes}))
    slowest = sorted(runs["after"].items(), key=lambda item: -item[1][0])[: args.top]
    for test_id, (seconds, outcome) in slowest:
        line = {"slowest": test_id, "seconds_after": round(seconds, 2), "kind": kind(test_id), "outcome": outcome}
        if "before" in runs and test_id in runs["before"]:
            line["seconds_before"] = round(runs["before"][test_id][0], 2)
        print(json.dumps(line))
    if "before" in runs:
        passed = {run: {t for t, (_, o) in tests.items() if o == "passed"} for run, tests in runs.items()}
        for test_id in sorted(passed["before"] ^ passed["after"]):
            print(json.dumps({"passed_in_one_run_only": test_id,
                              "before": runs["before"].get(test_id, (0, "absent"))[1],
                              "after": runs["after"].get(test_id, (0, "absent"))[1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
