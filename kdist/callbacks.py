"""Keras callbacks kdist provides: `kdist.callbacks.TensorBoard`.

```python
import kdist, keras
model.fit(x, y, epochs=3, callbacks=[kdist.callbacks.TensorBoard("logs")])
```

On torch, `keras.callbacks.TensorBoard(...)` already builds kdist's class when
TensorFlow or the tensorboard package is missing (once kdist is loaded); use
this name to get kdist's writer even where both are installed.
"""

from kdist.keras.tensorboard import TensorBoard

__all__ = ["TensorBoard"]
