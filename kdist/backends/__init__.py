"""kdist's strategies on the TensorFlow and JAX backends of Keras 3.

The torch backend is kdist's own engine (`kdist.distribute`, `kdist.keras`).
On the other two backends the same user-facing API delegates to what the
backend already does well:

- `tensorflow`: `tf.distribute.MirroredStrategy` and
  `MultiWorkerMirroredStrategy` (`kdist.backends.tensorflow`);
- `jax`: `keras.distribution.DataParallel` over the local devices
  (`kdist.backends.jax`).

`import kdist` binds `kdist.MirroredStrategy` (and the other strategy names)
to the implementation of the backend Keras was imported with. Which names a
backend supports is `SUPPORTED_BACKENDS` on each strategy class; see
`docs/backends.md`.
"""

from kdist._backend import current_backend


def visible_gpus():
    """The GPUs Keras' backend can use, as kdist device strings (`["cuda:0", ...]`).

    Example:

    ```python
    strategy = kdist.MirroredStrategy(kdist.visible_gpus() or ["cpu:0", "cpu:1"])
    ```
    """
    backend = current_backend()
    if backend == "tensorflow":
        from kdist.backends.tensorflow import gpu_count
    elif backend == "jax":
        from kdist.backends.jax import gpu_count
    else:
        import torch

        gpu_count = torch.cuda.device_count
    return [f"cuda:{index}" for index in range(gpu_count())]
