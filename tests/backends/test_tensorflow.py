"""kdist on Keras' TensorFlow backend across processes: `MultiWorkerMirroredStrategy` delegates to tf.distribute.

Two `TF_CONFIG` tasks on loopback (the cluster `kdist launch --workers 2`
builds) train with `kdist.MultiWorkerMirroredStrategy()`; both must end with
the weights and losses of single-process plain Keras on the same global
batches. Negative control: plain Keras on half the global batch (each worker
training on its own shard alone would look like that) ends elsewhere.
"""

from pathlib import Path

import numpy as np
import pytest

from tests import harness
from tests.backends import _matrix

WORKER = Path(__file__).with_name("tensorflow_multi_worker_worker.py")

pytestmark = pytest.mark.timeout(300)


def _result(run, name):
    [result] = _matrix.lines(run.output(name, "stdout"), "RESULT")
    return result


def test_multi_worker_mirrored_strategy_matches_one_process_plain_keras():
    _matrix.require_installed("tensorflow")
    tensorflow = {"KERAS_BACKEND": "tensorflow"}
    envs = [(name, {**env, **tensorflow}) for name, env in harness.tf_config_envs(2)]
    workers = harness.run(harness.python_specs(envs, WORKER), timeout=_matrix.TIMEOUT_SECONDS).check()
    references = harness.run(
        harness.python_specs([("reference-0", tensorflow)], WORKER, "--reference")
        + harness.python_specs([("half-0", tensorflow)], WORKER, "--reference", "--batch-size", 16),
        timeout=_matrix.TIMEOUT_SECONDS).check()
    expected = _result(references, "reference-0")
    half_batch = _result(references, "half-0")
    for index in range(2):
        result = _result(workers, f"worker-{index}")
        assert result["is_kdist"] == "kdist.backends.tensorflow"
        assert (result["num_replicas_in_sync"], result["input_pipeline_id"]) == (2, index)
        for got, want in zip(result["weights"], expected["weights"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result["loss"], expected["loss"], rtol=1e-5)
        difference = max(float(np.max(np.abs(np.asarray(got) - np.asarray(other))))
                         for got, other in zip(result["weights"], half_batch["weights"], strict=True))
        assert difference > 1e-3, difference


def test_gradient_compression_is_refused_on_tensorflow():
    # tf.distribute's collectives send gradients in their own dtype: asking for
    # bf16 must fail, naming the option, not train silently in full precision.
    _matrix.require_installed("tensorflow")
    script = (
        "import kdist, pytest\n"
        "options = kdist.CommunicationOptions(compression=kdist.Compression.bf16)\n"
        "with pytest.raises(kdist.errors.UnsupportedError, match='compression=kdist.Compression.bf16'):\n"
        "    kdist.MultiWorkerMirroredStrategy(communication_options=options)\n"
        "print('REFUSED')\n"
    )
    specs = harness.python_specs([("tf-0", {"KERAS_BACKEND": "tensorflow"})], "-c", script)
    run = harness.run(specs, timeout=_matrix.TIMEOUT_SECONDS).check()
    assert "REFUSED" in run.output("tf-0", "stdout")
