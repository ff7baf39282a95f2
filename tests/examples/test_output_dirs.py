"""The examples write nothing into the current directory unless told where to write.

Without `--out-dir` an example writes to a temporary directory (removed at exit,
or, for the coordinator example whose evaluator reads the chief's checkpoints, a
directory under the system's temporary directory named after the cluster).
`ps_tutorial.py` keeps TensorFlow's tutorial path, `/tmp/my_working_dir`.
"""

import importlib
import os
import sys
import tempfile

import pytest

from kdist.cluster import SimpleClusterResolver
from tests import harness

EXAMPLES = harness.REPO_ROOT / "examples"
WRITES_WITH_OUT_DIR = ("mirrored_digits", "multiworker_digits", "ps_async_digits", "ps_coordinator_fit")
WRITES_NOTHING = ("custom_loop_digits", "ps_coordinator_custom_loop", "ps_ranker", "lora_causal_lm")


def example(name):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # The examples import each other by file name.
    return importlib.import_module(name)


def test_every_example_is_covered():
    names = {path.stem for path in EXAMPLES.glob("*.py")}
    assert names == {*WRITES_WITH_OUT_DIR, *WRITES_NOTHING, "ps_tutorial"}


@pytest.mark.parametrize("name", WRITES_WITH_OUT_DIR)
def test_out_dir_defaults_to_none_meaning_a_temporary_directory(name):
    assert example(name).parse_args([]).out_dir is None
    assert example(name).parse_args(["--out-dir", "here"]).out_dir == "here"


@pytest.mark.parametrize("name", WRITES_NOTHING)
def test_examples_without_out_dir_write_no_files(name):
    source = (EXAMPLES / f"{name}.py").read_text()
    for writer in ("open(", ".save(", "Checkpoint(", "BackupAndRestore(", "CSVLogger(", "makedirs("):
        assert writer not in source, f"{name}.py calls {writer}; give it --out-dir"


def test_ps_tutorial_working_dir_is_absolute():
    assert os.path.isabs(example("ps_tutorial").parse_args([]).working_dir)


def test_coordinator_example_directory_is_shared_by_one_cluster_and_only_by_it():
    cluster_directory = example("ps_coordinator_fit").cluster_directory
    cluster = {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"], "ps": ["127.0.0.1:2002"]}
    chief = cluster_directory(SimpleClusterResolver(cluster, task_type="chief", task_id=0))
    evaluator = cluster_directory(SimpleClusterResolver(cluster, task_type="worker", task_id=0))
    other = cluster_directory(SimpleClusterResolver(dict(cluster, ps=["127.0.0.1:2003"])))
    assert chief == evaluator != other
    assert os.path.dirname(chief) == tempfile.gettempdir()


@pytest.mark.slow
def test_multiworker_example_leaves_the_current_directory_empty(tmp_path):
    argv = (sys.executable, str(EXAMPLES / "multiworker_digits.py"), "--samples", "64", "--epochs", "1")
    argv += ("--min-accuracy", "0")
    specs, directories = [], {}
    # "given" is the control: with a relative --out-dir the same check finds files.
    for name, extra in (("default", ()), ("given", ("--out-dir", "out"))):
        cwd, temporary = tmp_path / name / "cwd", tmp_path / name / "tmp"
        cwd.mkdir(parents=True)
        temporary.mkdir()
        directories[name] = (cwd, temporary)
        env = {"TMPDIR": str(temporary), "TF_CONFIG": None, "RANK": None, "WORLD_SIZE": None}
        specs.append(harness.ProcessSpec(name, (*argv, *extra), env, cwd=str(cwd)))
    result = harness.run(specs, timeout=240).check()

    for name in directories:
        assert '"checkpoint_saved": true' in result.output(name, "stdout"), result.output(name)
    cwd, temporary = directories["default"]
    assert list(cwd.iterdir()) == []
    # Its temporary directory is gone too.
    assert [path for path in temporary.iterdir() if path.name.startswith("multiworker_digits_")] == []
    cwd, _ = directories["given"]
    assert [path.name for path in cwd.iterdir()] == ["out"]
