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

It is not collected by the repository's pytest (`testpaths = ["tests"]`).
"""

import argparse
import collections
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
# What a library run covers by default: the tests that build, fit, save or predict models.
LIBRARY_FILES = {
    "keras-hub": ("keras_hub/src/models/*/*_backbone_test.py", "keras_hub/src/models/*/*_causal_lm_test.py",
                  "keras_hub/src/models/*/*_classifier_test.py"),
    "keras-rs": ("keras_rs/src/layers/*/*_test.py", "keras_rs/src/losses/*_test.py"),
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


def run_pytest(python, cwd, options, targets, mode, keyword, work):
    """pytest in `cwd` on `targets` with kdist's plugin; `--kdist-mirrored` in the mirrored run."""
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kdist_suite_plugin", *options,
            f"--junitxml={work / (mode + '.xml')}"]
    if mode == "mirrored":
        args.append("--kdist-mirrored")
    if keyword:
        args += ["-k", keyword]
    args += targets
    env = {**os.environ, "KERAS_BACKEND": "torch",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    with open(work / f"{mode}.log", "w") as out:
        code = subprocess.run(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return code, time.monotonic() - start


def checkout_tests(checkout, patterns):
    """The test files of a library checkout matching `patterns` (paths relative to the checkout)."""
    found = []
    for pattern in patterns:
        found += sorted(str(pathlib.Path(path).relative_to(checkout)) for path in glob.glob(str(checkout / pattern)))
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


def compare(plain, mirrored):
    tally = collections.Counter()
    rows = {}
    for test_id in sorted(set(plain) | set(mirrored)):
        one, two = plain.get(test_id, ("absent", "")), mirrored.get(test_id, ("absent", ""))
        tally[f"{one[0]} plain / {two[0]} mirrored"] += 1
        rows[test_id] = {"plain": one[0], "mirrored": two[0], "mirrored_message": two[1]}
    return tally, rows


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
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("--only", choices=("plain", "mirrored"), default=None, help="run one configuration")
    options = parser.parse_args(argv)
    work = pathlib.Path(options.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
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
        copied = checkout_tests(checkout, options.files or LIBRARY_FILES[options.library])
        # In the checkout, with its own conftest.py and markers.
        cwd, pytest_options, targets = checkout, ["--timeout", "300", "--rootdir", str(checkout)], copied
    for mode in modes:
        code, seconds = run_pytest(options.python, cwd, pytest_options, targets, mode, options.keyword, work)
        print(json.dumps({"what": "keras_suite", "library": options.library, "mode": mode, "version": version,
                          "files": len(copied), "exit_code": code, "seconds": round(seconds, 1)}), flush=True)
    if not all((work / f"{mode}.xml").exists() for mode in ("plain", "mirrored")):
        return 0
    tally, rows = compare(outcomes(work / "plain.xml"), outcomes(work / "mirrored.xml"))
    (work / "comparison.json").write_text(json.dumps({"version": version, "tally": tally, "tests": rows}, indent=1))
    print(json.dumps({"what": "keras_suite_tally", "version": version, **tally}), flush=True)
    for test_id, row in rows.items():
        if row["plain"] == "passed" and row["mirrored"] != "passed":
            print(f"{test_id}: {row['mirrored']}: {row['mirrored_message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
