"""benchmarks/keras_suite/run.py: the logic that turns its runs into one comparison.

The runs themselves take minutes to an hour (they are a measurement, outside the
suite); these tests check how files are chosen, how the ranks of a multi-worker run
become one outcome per test, and how chunks are joined.
"""

import json

import pytest

from tests import harness

SUITE = harness.REPO_ROOT / "benchmarks" / "keras_suite"


@pytest.fixture
def run(monkeypatch):
    monkeypatch.syspath_prepend(str(SUITE))
    import run

    return run


def test_library_files_reach_every_folder_and_leave_out_pipelines(run, tmp_path):
    for name in ("models/task_test.py", "models/gpt2/gpt2_backbone_test.py", "models/gpt2/gpt2_tokenizer_test.py",
                 "models/sam/deep/sam_layer_test.py", "models/vit/vit_image_converter_test.py", "models/vit/vit.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    found = run.checkout_tests(tmp_path, ("models/**/*_test.py", "models/gpt2/*_test.py"),
                               ("*_tokenizer_test.py", "*_converter_test.py"))
    assert found == ["models/gpt2/gpt2_backbone_test.py", "models/sam/deep/sam_layer_test.py", "models/task_test.py"]
    assert len(run.checkout_tests(tmp_path, ("models/**/*_test.py",))) == 5


def test_a_multi_worker_test_passes_only_where_every_rank_passed(run):
    rank0 = {"a": ("passed", ""), "b": ("passed", ""), "c": ("skipped", "large"), "d": ("passed", ""),
             "e": ("skipped", "large"), "f": ("skipped", "why")}
    rank1 = {"a": ("passed", ""), "b": ("failed", "CollectiveTimeoutError"), "c": ("skipped", "large"),
             "e": ("passed", ""), "f": ("failed", "boom")}
    combined = run.combine_ranks([rank0, rank1])
    assert combined == {
        "a": ("passed", ""),
        "b": ("failed", "rank 1: failed: CollectiveTimeoutError"),
        "c": ("skipped", "large"),
        "d": ("failed", "rank 1: absent: "),  # rank 1 died before it
        "e": ("failed", "rank 0: skipped: large"),  # the ranks disagree
        "f": ("failed", "rank 1: failed: boom"),  # a failure names itself before a skip
    }


def test_chunks_join_into_one_comparison(run, tmp_path):
    chunks = [
        {"version": "keras-hub 0.32.0", "tally": {"passed plain / passed mirrored": 2},
         "tests": {"a": {"plain": "passed", "mirrored": "passed"}, "b": {"plain": "passed", "mirrored": "passed"}}},
        {"version": "keras-hub 0.32.0", "tally": {"passed plain / passed mirrored": 1,
                                                  "passed plain / failed mirrored": 1},
         "tests": {"c": {"plain": "passed", "mirrored": "passed"},
                   "d": {"plain": "passed", "mirrored": "failed", "mirrored_message": "E"}}},
        {"version": "keras-hub 0.32.0", "tally": {"passed plain / passed multi-worker": 1},
         "tests": {"a": {"plain": "passed", "multi-worker": "passed", "multi-worker_message": ""}}},
    ]
    paths = []
    for index, chunk in enumerate(chunks):
        paths.append(tmp_path / f"{index}.json")
        paths[-1].write_text(json.dumps(chunk))
    merged = run.merge_comparisons(paths)
    assert merged["version"] == "keras-hub 0.32.0"
    assert merged["tally"] == {"passed plain / passed mirrored": 3, "passed plain / failed mirrored": 1,
                               "passed plain / passed multi-worker": 1}
    assert sorted(merged["tests"]) == ["a", "b", "c", "d"]
    assert merged["tests"]["a"] == {"plain": "passed", "mirrored": "passed", "multi-worker": "passed",
                                    "multi-worker_message": ""}


def test_each_rank_writes_its_own_junit_file(monkeypatch):
    monkeypatch.syspath_prepend(str(SUITE))
    import kdist_suite_plugin

    assert kdist_suite_plugin.rank_xml_path("/tmp/a.b/multi-worker.xml", 1) == "/tmp/a.b/multi-worker-rank1.xml"
