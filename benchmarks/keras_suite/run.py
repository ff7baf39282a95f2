"""Runs Keras' own tests twice, plain and under `MirroredStrategy(["cpu:0", "cpu:1"])`, and compares.

Keras' wheel ships no tests, so the runner takes them from Keras' source
distribution of the installed version (`pip download keras==X --no-binary :all:`),
copies the chosen test files into a work folder, and runs pytest on them twice
with `kdist_suite_plugin`: once as plain Keras, once with every test inside a
2-replica strategy's scope. It prints one JSON line per run and a tally, and
writes `comparison.json` (every test's two outcomes, and the first line of each
failure under the strategy) to the work folder.

Usage (from the repository root; about 10 minutes on 2 CPU cores):

    python benchmarks/keras_suite/run.py --work /tmp/keras_suite
    python benchmarks/keras_suite/run.py --work /tmp/keras_suite -k "fit or evaluate"
    python benchmarks/keras_suite/run.py --work /tmp/keras_suite --only mirrored

keras-hub's and keras-rs's own tests are not in their wheels either: give a checkout of
the library's repository at the installed version (never copied into this repository).
The tests run in the checkout, with its own `conftest.py`, plus this plugin:

    python benchmarks/keras_suite/run.py --library keras-hub --checkout ~/src/keras-hub --work /tmp/hub_suite
    python benchmarks/keras_suite/run.py --library keras-rs --checkout ~/src/keras-rs --work /tmp/rs_suite

keras-hub's default is every test file under `keras_hub/src/models` but its tokenizer,
preprocessor and converter tests (`--exclude` to change); no test may download
(`--kdist-offline`: sockets connect to this host only). The whole of it is slow on 2
cores: run it in chunks, one work folder each, and join their results:

    python benchmarks/keras_suite/run.py --library keras-hub --checkout ~/src/keras-hub --work /tmp/hub/a-d \
        --files 'keras_hub/src/models/*_test.py' 'keras_hub/src/models/[a-d]*/**/*_test.py'
    python benchmarks/keras_suite/run.py --work /tmp/hub/all --merge /tmp/hub/a-d /tmp/hub/e-z

A sample under 2 real processes: `--only multi-worker` runs the same pytest in each
process of `kdist launch --nproc 2`, every test inside one
`MultiWorkerMirroredStrategy()`'s scope; a test passes only if it passes on every rank,
and is compared with the plain run in the same work folder:

    python benchmarks/keras_suite/run.py --library keras-hub --checkout ~/src/keras-hub --work /tmp/hub_mw \
        --files 'keras_hub/src/models/gpt2/gpt2_backbone_test.py' --only plain
    python benchmarks/keras_suite/run.py --library keras-hub --checkout ~/src/keras-hub --work /tmp/hub_mw \
        --files 'keras_hub/src/models/gpt2/gpt2_backbone_test.py' --only multi-worker

It is not collected by the repository's pytest (`testpaths = ["tests"]`).
"""

import argparse
import collections
import fnmatch
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_FILES = (
    "trainers/trainer_test.py",
    "models/model_test.py",
    "callbacks/*_test.py",
    "optimizers/*_test.py",
    "utils/torch_utils_test.py",
)
# The configurations a test runs in; every one after `plain` is compared with it.
MODES = ("plain", "mirrored", "multi-worker")
# What a library run covers by default: the tests that build, fit, save or predict models
# (`**` reaches every folder; LIBRARY_EXCLUDED then drops what builds no model).
LIBRARY_FILES = {
    "keras-hub": ("keras_hub/src/models/**/*_test.py",),
    "keras-rs": ("keras_rs/src/layers/*/*_test.py", "keras_rs/src/losses/*_test.py"),
}
# File names (fnmatch) left out of a library run: keras-hub's tokenizer, preprocessor and
# image/audio converter tests run data pipelines only, with no model to attach.
LIBRARY_EXCLUDED = {
    "keras-hub": ("*_tokenizer_test.py", "*_preprocessor_test.py", "*_converter_test.py"),
    "keras-rs": (),
}
# Where each library's checkout keeps its version string.
VERSION_FILES = {"keras-hub": "keras_hub/src/version.py", "keras-rs": "keras_rs/src/version.py"}
# Keras' own pytest settings (its pyproject.toml), so warnings fail tests as in Keras' CI.
PYTEST_INI = """[pytest]
filterwarnings =
    error
    ignore::DeprecationWarning
    ignore::ImportWarning
    ignore::RuntimeWarning
    ignore::PendingDeprecationWarning
    ignore::FutureWarning
    ignore::UserWarning
    ignore:Custom mask layers require a config
timeout = 300
"""


def keras_sources(work, python):
    """The `keras/src` folder of the installed Keras version's sdist (downloaded once into `work`)."""
    version = subprocess.run([python, "-c", "import keras; print(keras.version())"], capture_output=True,
                             text=True, check=True, env={**os.environ, "KERAS_BACKEND": "torch"}).stdout.strip()
    source = work / f"keras-{version}" / "keras" / "src"
    if source.is_dir():
        return version, source
    download = work / "sdist"
    subprocess.run([python, "-m", "pip", "download", f"keras=={version}", "--no-binary", ":all:", "--no-deps",
                    "-d", str(download)], check=True)
    with tarfile.open(download / f"keras-{version}.tar.gz") as archive:
        archive.extractall(work, filter="data")
    return version, source


def copy_tests(source, patterns, folder):
    """Copies the test files flat into `folder` (no `__init__.py`: the installed Keras is the one imported)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    copied = []
    for pattern in patterns:
        for path in sorted(glob.glob(str(source / pattern))):
            relative = pathlib.Path(path).relative_to(source)
            target = folder / "__".join(relative.parts)
            shutil.copy(path, target)
            copied.append(target.name)
    (folder / "pytest.ini").write_text(PYTEST_INI)
    shutil.copy(HERE / "keras_conftest.py", folder / "conftest.py")
    return copied


def run_pytest(python, cwd, options, targets, mode, keyword, work, nproc=2):
    """pytest in `cwd` on `targets` with kdist's plugin, configured for `mode`.

    `mirrored` adds `--kdist-mirrored`; `multi-worker` runs the same pytest in each of
    `nproc` processes of `kdist launch --nproc` with `--kdist-multi-worker` (each rank
    writes `multi-worker-rankR.xml`; the launcher keeps every rank's log in
    `multi-worker-logs/`).
    """
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kdist_suite_plugin", *options,
            f"--junitxml={work / (mode + '.xml')}"]
    if mode == "mirrored":
        args.append("--kdist-mirrored")
    if mode == "multi-worker":
        for stale in work.glob("multi-worker-rank*.xml"):
            stale.unlink()
        launch = [python, "-m", "kdist", "launch", "--nproc", str(nproc), "--log-dir", str(work / "multi-worker-logs")]
        args = [*launch, "-m", *args[2:], "--kdist-multi-worker"]
    if keyword:
        args += ["-k", keyword]
    args += targets
    env = {**os.environ, "KERAS_BACKEND": "torch",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    with open(work / f"{mode}.log", "w") as out:
        code = subprocess.run(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return code, time.monotonic() - start


def checkout_tests(checkout, patterns, excluded=()):
    """The test files of a library checkout matching `patterns` but no file name in `excluded`.

    Paths are relative to the checkout, sorted within each pattern, each once.
    """
    found = []
    for pattern in patterns:
        for path in sorted(glob.glob(str(checkout / pattern), recursive=True)):
            relative = str(pathlib.Path(path).relative_to(checkout))
            name = pathlib.PurePath(relative).name
            if relative not in found and not any(fnmatch.fnmatch(name, rule) for rule in excluded):
                found.append(relative)
    return found


def library_versions(python, library, checkout):
    """`(installed, checkout)` version strings of `library`."""
    module = library.replace("-", "_")
    installed = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                               text=True, env={**os.environ, "KERAS_BACKEND": "torch"}).stdout.strip()
    text = (checkout / VERSION_FILES[library]).read_text()
    found = __import__("re").search(r"__version__ = \"([^\"]+)\"", text)
    return installed, found.group(1) if found else "unknown"


def outcomes(xml_path):
    """`{test id: (outcome, first line of the failure message)}` from a junit XML file."""
    results = {}
    for case in ElementTree.parse(xml_path).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (element.get("message") or element.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        results[test_id] = (outcome, message)
    return results


def combine_ranks(per_rank):
    """One outcome per test from `[{test id: (outcome, message)}, ...]`, one dict per rank.

    A test passed if it passed on every rank and was skipped if every rank skipped it.
    Otherwise it failed, with the message of the rank that shows why best (`rank R:
    failed: ...` before `absent`, where that rank has no result for the test, e.g. its
    process died, before `skipped`, where the ranks disagree about skipping).
    """
    worst_first = {"failed": 0, "absent": 1, "skipped": 2, "passed": 3}
    combined = {}
    for test_id in sorted(set().union(*per_rank)):
        results = [ranked.get(test_id, ("absent", "")) for ranked in per_rank]
        kinds = {outcome for outcome, _ in results}
        if kinds in ({"passed"}, {"skipped"}):
            combined[test_id] = (kinds.pop(), results[0][1])
            continue
        rank = min(range(len(results)), key=lambda rank: (worst_first[results[rank][0]], rank))
        outcome, message = results[rank]
        combined[test_id] = ("failed", f"rank {rank}: {outcome}: {message}"[:300])
    return combined


def mode_outcomes(work, mode, nproc):
    """The outcomes of `mode`'s run in `work` (every rank's combined for `multi-worker`), or None."""
    if mode != "multi-worker":
        path = work / f"{mode}.xml"
        return outcomes(path) if path.exists() else None
    paths = [work / f"multi-worker-rank{rank}.xml" for rank in range(nproc)]
    if not any(path.exists() for path in paths):
        return None
    return combine_ranks([outcomes(path) if path.exists() else {} for path in paths])


def compare(plain, other, mode="mirrored"):
    """`(tally, rows)`: how many tests had each pair of outcomes, and each test's two outcomes."""
    tally = collections.Counter()
    rows = {}
    for test_id in sorted(set(plain) | set(other)):
        one, two = plain.get(test_id, ("absent", "")), other.get(test_id, ("absent", ""))
        tally[f"{one[0]} plain / {two[0]} {mode}"] += 1
        rows[test_id] = {"plain": one[0], mode: two[0], f"{mode}_message": two[1]}
    return tally, rows


def merge_comparisons(paths):
    """One `comparison.json` from several (chunks of one run): tallies summed, tests joined."""
    tally, rows, versions = collections.Counter(), {}, []
    for path in paths:
        part = json.loads(pathlib.Path(path).read_text())
        tally.update(part["tally"])
        for test_id, row in part["tests"].items():
            rows.setdefault(test_id, {}).update(row)
        if part["version"] not in versions:
            versions.append(part["version"])
    return {"version": "; ".join(versions), "tally": dict(sorted(tally.items())), "tests": rows}


def report(comparison):
    """Prints the tally (one line per compared mode) and each test that passed plain only."""
    for mode in MODES[1:]:
        counts = {key: count for key, count in comparison["tally"].items() if key.endswith(f" {mode}")}
        if counts:
            print(json.dumps({"what": "keras_suite_tally", "version": comparison["version"], **counts}), flush=True)
    for test_id, row in comparison["tests"].items():
        for mode in MODES[1:]:
            if row.get("plain") == "passed" and row.get(mode, "passed") != "passed":
                print(f"{test_id}: {mode}: {row[mode]}: {row.get(mode + '_message', '')}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/keras_suite", help="work folder (sdist, copies, logs, results)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose Keras is tested")
    parser.add_argument("--library", choices=("keras", "keras-hub", "keras-rs"), default="keras",
                        help="whose own tests run")
    parser.add_argument("--checkout", default=None,
                        help="keras-hub/keras-rs: the library's repository at the installed version")
    parser.add_argument("--files", nargs="*", default=None,
                        help="globs under keras/src (keras) or under the checkout (the other libraries)")
    parser.add_argument("--exclude", nargs="*", default=None,
                        help="file names (fnmatch) left out of a library run (default: LIBRARY_EXCLUDED)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("--only", choices=MODES, default=None,
                        help="run one configuration (default: plain, then mirrored)")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the multi-worker run")
    parser.add_argument("--merge", nargs="+", default=None, metavar="WORK",
                        help="join the comparison.json of these work folders (chunks) into --work's; runs nothing")
    options = parser.parse_args(argv)
    work = pathlib.Path(options.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if options.merge:
        comparison = merge_comparisons([pathlib.Path(folder) / "comparison.json" for folder in options.merge])
        (work / "comparison.json").write_text(json.dumps(comparison, indent=1))
        report(comparison)
        return 0
    modes = [options.only] if options.only else ["plain", "mirrored"]
    if options.library == "keras":
        version, source = keras_sources(work, options.python)
        folder = work / "tests"
        copied = copy_tests(source, options.files or list(DEFAULT_FILES), folder)
        # Keras' copied tests run with Keras' own settings (PYTEST_INI) and this conftest.
        cwd, pytest_options, targets = folder, ["-c", str(folder / "pytest.ini"), "--rootdir", str(folder)], [str(folder)]
    else:
        if options.checkout is None:
            parser.error(f"--library {options.library} needs --checkout: its tests are not in its wheel")
        checkout = pathlib.Path(options.checkout).expanduser().resolve()
        installed, checked_out = library_versions(options.python, options.library, checkout)
        version = f"{options.library} {installed} (checkout {checked_out})"
        excluded = LIBRARY_EXCLUDED[options.library] if options.exclude is None else options.exclude
        copied = checkout_tests(checkout, options.files or LIBRARY_FILES[options.library], excluded)
        # In the checkout, with its own conftest.py and markers.
        cwd, pytest_options, targets = checkout, ["--timeout", "300", "--rootdir", str(checkout), "--kdist-offline"], copied
    for mode in modes:
        code, seconds = run_pytest(options.python, cwd, pytest_options, targets, mode, options.keyword, work,
                                   options.nproc)
        print(json.dumps({"what": "keras_suite", "library": options.library, "mode": mode, "version": version,
                          "files": len(copied), "exit_code": code, "seconds": round(seconds, 1)}), flush=True)
    # Every configuration whose results are in `work` (this call's or an earlier one's) against the plain run.
    plain = mode_outcomes(work, "plain", options.nproc)
    if plain is None:
        return 0
    tally, rows = collections.Counter(), {}
    for mode in MODES[1:]:
        other = mode_outcomes(work, mode, options.nproc)
        if other is not None:
            counts, pairs = compare(plain, other, mode)
            tally.update(counts)
            for test_id, row in pairs.items():
                rows.setdefault(test_id, {}).update(row)
    if not rows:
        return 0
    comparison = {"version": version, "tally": dict(sorted(tally.items())), "tests": rows}
    (work / "comparison.json").write_text(json.dumps(comparison, indent=1))
    report(comparison)
    return 0


if __name__ == "__main__":
    sys.exit(main())
