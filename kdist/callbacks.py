"""Keras callbacks kdist provides: `kdist.callbacks.TensorBoard`.

```python
import kdist, keras
model.fit(x, y, epochs=3, callbacks=[kdist.callbacks.TensorBoard("logs")])
```

On torch, `keras.callbacks.TensorBoard(...)` already builds kdist's class when
TensorFlow or the tensorboard package is missing or fails to import (once a
`kdist.<name>` was used). One built earlier, by Keras, becomes kdist's class
when a model of a kdist strategy's scope receives it in `fit`, `evaluate` or
`predict`; a model outside any kdist scope runs Keras' callback unchanged.
Use this name to get kdist's writer even where both are installed. It writes
with tensorboardX (`pip install tensorboardX`).
"""

from kdist.keras.tensorboard import TensorBoard

__all__ = ["TensorBoard"]
