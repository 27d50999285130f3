"""Step hooks installed on activation: Keras `Model.fit` and `tf.compat.v1.Session.run`.

Custom tf.function loops run Python once per step outside the graph, so they mark steps with
`tf_antman.step()` or `tf_antman.step_end()` (docs/steps.md says why no automatic detection is
sound there).
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any

from tf_antman._log import log
from tf_antman.steps import StepTracker

# Optimizer update kernels: a Session.run whose fetches reach one of these is a training step.
TRAINING_OP_RE = re.compile(r"^(Resource)?(Sparse)?Apply[A-Z]")
_MARK = "_tf_antman_wrapped"


def keras_callback(steps: StepTracker) -> Any:
    import keras

    class AntmanCallback(keras.callbacks.Callback):
        """Times each training batch; evaluation/predict batches are not steps."""

        def __init__(self) -> None:
            super().__init__()
            self._t0 = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps.step_end(time.perf_counter() - self._t0, training=True)

    return AntmanCallback()


def install_keras_hook(steps: StepTracker) -> None:
    import keras

    fit = keras.Model.fit
    if getattr(fit, _MARK, False):
        return

    @functools.wraps(fit)
    def fit_with_antman(self: Any, *args: Any, **kwargs: Any) -> Any:
        callbacks = list(kwargs.get("callbacks") or [])
        if not any(type(c).__name__ == "AntmanCallback" for c in callbacks):
            callbacks.append(keras_callback(steps))
        kwargs["callbacks"] = callbacks
        return fit(self, *args, **kwargs)

    setattr(fit_with_antman, _MARK, True)
    keras.Model.fit = fit_with_antman
    log.info("step hook installed on keras.Model.fit")


class _TrainingFetchCache:
    """Is a Session.run a training step? Walks the fetched subgraph once per fetch set."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, tuple[str, ...]], bool] = {}

    def is_training(self, graph: Any, fetches: Any) -> bool:
        import tensorflow as tf

        try:
            flat = tf.nest.flatten(fetches)
            elems = [graph.as_graph_element(f, allow_tensor=True, allow_operation=True) for f in flat]
        except Exception:  # noqa: BLE001 - odd fetch types: not something we can classify
            return False
        key = (id(graph), tuple(sorted(e.name for e in elems)))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._walk([e if isinstance(e, tf.Operation) else e.op for e in elems])
            self._cache[key] = hit
        return hit

    @staticmethod
    def _walk(ops: list[Any]) -> bool:
        seen: set[str] = set()
        stack = list(ops)
        while stack:
            op = stack.pop()
            if op.name in seen:
                continue
            seen.add(op.name)
            if TRAINING_OP_RE.match(op.type):
                return True
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        return False


def install_session_hook(steps: StepTracker) -> None:
    from tensorflow.python.client import session as tf_session

    run = tf_session.BaseSession.run
    if getattr(run, _MARK, False):
        return
    cache = _TrainingFetchCache()

    @functools.wraps(run)
    def run_with_antman(self: Any, fetches: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = run(self, fetches, *args, **kwargs)
        if cache.is_training(self.graph, fetches):
            steps.step_end(time.perf_counter() - t0, training=True)
        return out

    setattr(run_with_antman, _MARK, True)
    tf_session.BaseSession.run = run_with_antman
