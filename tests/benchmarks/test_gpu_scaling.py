"""benchmarks/gpu_scaling.py: the no-GPU exit, the CPU smoke run of every code path but NCCL, and the GPU run."""

import json
import sys

import pytest

from tests import harness

SCRIPT = harness.REPO_ROOT / "benchmarks" / "gpu_scaling.py"
ONE_PROCESS_AND_KDIST = ("plain", "mirrored", "kdist_fp32")


def _run(*args, env=None, timeout=120):
    specs = harness.python_specs([("driver", env or {})], SCRIPT, *args)
    result = harness.run(specs, timeout=timeout)
    result.check()
    lines = [json.loads(line) for line in result.output("driver", "stdout").splitlines() if line.startswith("{")]
    return result, lines


@pytest.fixture
def gpu_scaling(monkeypatch):
    # The benchmarks import each other by file name, as when run as scripts.
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_scaling

    return gpu_scaling


def test_without_gpu_the_default_run_exits_zero_and_says_nothing_was_measured():
    # Hides any GPU, so this holds on a GPU machine too.
    result, lines = _run(env={"CUDA_VISIBLE_DEVICES": ""}, timeout=60)
    assert result.returncodes["driver"] == 0
    assert result.output("driver", "stdout").strip().count("\n") == 0, "expected exactly one line"
    assert len(lines) == 1
    assert lines[0]["benchmark"] == "gpu_scaling"
    assert lines[0]["measured"] is False
    assert "no GPU" in lines[0]["skipped"] and "nothing was measured" in lines[0]["skipped"]


def _check_model_lines(lines, device):
    assert [line["model"] for line in lines] == ["convnet", "transformer"]
    for line in lines:
        assert line["failed"] == {}, line["failed"]
        # Only the upstream baseline may be retried; a kdist configuration's failure stands.
        assert set(line["retried"]) <= {"keras316_ddp"}, line["retried"]
        assert line["environment"]["backend"] == ("nccl" if device == "cuda" else "gloo")
        rates = line["samples_per_sec"]
        for config in ONE_PROCESS_AND_KDIST:
            assert rates[config] > 0, config
        for config in ("kdist_bf16", "keras316_ddp"):
            # Either measured, or skipped with a reason, never silently missing.
            assert (config in rates) != (config in line["skipped"]), config
            assert config in rates or line["skipped"][config]
        assert set(line["scaling_efficiency"]) == set(rates) - {"plain"}
        assert line["scaling_efficiency"]["kdist_fp32"] == pytest.approx(
            rates["kdist_fp32"] / (line["num_gpus"] * rates["plain"]), rel=0.01
        )
        if "keras316_ddp" in rates:
            assert line["keras316_ddp_wrapped"] is True  # Keras' DDP path ran, not a plain fit
            assert line["ratios"]["kdist_fp32/keras316_ddp"] > 0
        assert line["gradient_wire_bytes_per_step"]["kdist_fp32"] > 0


def test_cpu_smoke_run_measures_every_configuration_on_gloo():
    # Tiny models, 2 logical GPUs, 2 processes under `kdist launch`: about 20 s on 2 idle cores.
    # One timed step per configuration is enough to show each one runs and is measured.
    result, lines = _run("--device", "cpu", "--quick", "--rounds", "1", "--steps", "1", "--warmup", "1", timeout=180)
    _check_model_lines(lines, "cpu")
    assert all(line["num_gpus"] == 2 and line["environment"]["device"] == "cpu" for line in lines)


def test_unavailable_configurations_are_skipped_with_a_reason(gpu_scaling, monkeypatch):
    import kdist

    args = gpu_scaling.parse_args(["--device", "cpu"])
    monkeypatch.delattr(kdist, "Compression", raising=False)
    reasons = gpu_scaling.skip_reasons(args, "/nowhere/python does not exist")
    assert set(reasons) == {"kdist_bf16", "keras316_ddp"}
    assert "compression" in reasons["kdist_bf16"]
    assert "/nowhere/python does not exist" in reasons["keras316_ddp"]
    line = gpu_scaling.model_line(args, "convnet", {}, reasons, {"mirrored": "exit code 1: boom"})
    assert line["skipped"] == reasons and line["failed"] == {"mirrored": "exit code 1: boom"}
    assert line["samples_per_sec"] == {} and line["scaling_efficiency"] == {}


def test_launched_configurations_go_through_kdist_launch(gpu_scaling):
    args = gpu_scaling.parse_args(["--device", "cpu", "--quick", "--num-gpus", "4"])
    launched = gpu_scaling.job_command(args, "kdist_bf16", sys.executable)
    assert launched[1:6] == ["-m", "kdist", "launch", "--nproc", "4"]
    assert launched[launched.index("--role") + 1] == "kdist_bf16"
    one_process = gpu_scaling.job_command(args, "mirrored", sys.executable)
    assert "launch" not in one_process and one_process[one_process.index("--num-gpus") + 1] == "4"


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_quick_run_measures_every_configuration_on_nccl():
    import torch

    result, lines = _run("--quick", timeout=540)
    _check_model_lines(lines, "cuda")
    assert all(line["num_gpus"] == torch.cuda.device_count() for line in lines)


def test_tiny_models_keep_every_layer_of_the_full_ones(gpu_scaling):
    # replica_host_time.py measures host time on "tiny": the same ops per step as "full", little arithmetic.
    import keras

    for model_name in gpu_scaling.MODELS:
        full = gpu_scaling.build_model(keras, model_name, gpu_scaling.SIZES["full"][model_name])
        tiny = gpu_scaling.build_model(keras, model_name, gpu_scaling.SIZES["tiny"][model_name])
        assert [type(layer) for layer in tiny.layers] == [type(layer) for layer in full.layers], model_name
        assert len(tiny.variables) == len(full.variables), model_name
        assert tiny.count_params() < full.count_params() / 1000, model_name


def test_replica_host_time_smoke_run():
    script = SCRIPT.parent / "replica_host_time.py"
    specs = harness.python_specs([("driver", {})], script, "--quick", "--models", "transformer", "--steps", "2",
                                 "--rounds", "1")
    result = harness.run(specs, timeout=120)
    result.check()
    (line,) = [json.loads(text) for text in result.output("driver", "stdout").splitlines() if text.startswith("{")]
    assert line["benchmark"] == "replica_host_time" and line["model"] == "transformer"
    assert set(line["step_cpu_ms"]) == {"plain", "plain_double_batch", "mirrored_2", "mirrored_4"}
    assert line["host_ms_per_replica_step"] > 0
    assert set(line["gpus_one_process_can_feed"]) == {"10ms", "30ms", "100ms"}
