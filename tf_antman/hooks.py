"""Step hooks: where a user's training loop reaches a mini-batch boundary (docs/steps.md).

- Keras 3 (`keras`, `tf.keras` with TF 2.21) and tf_keras (`TF_USE_LEGACY_KERAS=1`, `import
  tf_keras`): `fit` gets a callback that marks each training batch; `train_on_batch` is one step.
- `tf.compat.v1.Session.run` and `Session.make_callable`: a run is a step when its fetches reach
  an optimizer update (`TrainingFetches` says which).
- Custom `tf.function` loops mark steps themselves with `tf_antman.step()`.

The patches are installed when the module defining each class has finished importing
(importhook), and look up tf-antman's state at call time through the function activation hands
`register_import_hooks` (no import of activation here: it imports this module): without an active
state they call straight through.
Work done inside a marked step (a `fit`, a `train_on_batch`, a `tf_antman.step()`) is not counted
again by the hooks inside it (tf_keras in graph mode runs its batches through a Session; a user
may mark a step around `train_on_batch`): steps.marked_step().
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tf_antman import importhook
from tf_antman._log import log
from tf_antman.steps import StepTracker, inside_marked_step, marked_step

_MARK = "_tf_antman_wrapped"
_CALLBACK_MARK = "_tf_antman_callback"

# Where each patched class is defined (TF 2.21, Keras 3.x, tf_keras 2.21).
KERAS3_TRAINER = ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")
TF_KERAS_MODELS = (("tf_keras.src.engine.training", "Model"),
                   ("tf_keras.src.engine.training_v1", "Model"))  # v1: graph mode (no eager)
SESSION_MODULE = "tensorflow.python.client.session"

# --- What makes a Session.run a training step -----------------------------------------------
# Every optimizer kernel of TF 2.21: Apply*, ResourceApply*, SparseApply*, ResourceSparseApply*,
# and the gradient accumulators of synchronous replicas ((Resource|Sparse)AccumulatorApplyGradient).
OPTIMIZER_KERNEL_RE = re.compile(r"^(Resource)?(Sparse)?(Accumulator)?Apply[A-Z]")
# Variable writes that read the variable's current value: an update by definition (Keras 3
# optimizers in a graph write `variable.assign_sub(lr * grad)` / `assign_add`).
READ_MODIFY_WRITE_OPS = frozenset({
    "AssignAdd", "AssignSub", "AssignAddVariableOp", "AssignSubVariableOp",
    "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv", "ScatterMin", "ScatterMax",
    "ScatterNdAdd", "ScatterNdSub", "ScatterNdMin", "ScatterNdMax",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMin", "ResourceScatterMax",
    "ResourceScatterNdAdd", "ResourceScatterNdSub", "ResourceScatterNdMin", "ResourceScatterNdMax",
})
# Variable writes that replace the value: an update only when the new value is computed from the
# variable itself (`v.assign(v - lr * g)`); initialisers, checkpoint restores and set_weights
# write values that do not read it, and are not steps.
OVERWRITE_OPS = frozenset({
    "Assign", "AssignVariableOp", "ScatterUpdate", "ScatterNdUpdate", "ResourceScatterUpdate",
    "ResourceScatterNdUpdate", "StridedSliceAssign", "ResourceStridedSliceAssign",
    "AssignVariableXlaConcatND",
})
# Ops of TF 2.21 whose names say Apply/Assign/Scatter but that write no variable (they make a new
# tensor or act on a collective group): listed so that a test can show the lists above complete.
NOT_VARIABLE_WRITES = frozenset({
    "ScatterNd", "ScatterNdNonAliasingAdd", "TensorScatterAdd", "TensorScatterMax", "TensorScatterMin",
    "TensorScatterSub", "TensorScatterUpdate", "TensorArrayScatter", "TensorArrayScatterV2",
    "TensorArrayScatterV3", "TensorListScatter", "TensorListScatterIntoExistingList", "TensorListScatterV2",
    "CollectiveReduceScatterV2", "CollectiveAssignGroupV2",
})
VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable", "_VarHandlesOp"})
_HANDLE_PASS_THROUGH = frozenset({"Identity", "RefIdentity", "Enter", "RefEnter", "Switch", "RefSwitch"})


class TrainingFetches:
    """Is a Session.run a training step? Walks the fetched subgraph once per distinct fetch set.

    Rule (docs/steps.md): the fetches reach, through data or control edges, an optimizer kernel,
    or a write to a *trainable* variable (the graph's TRAINABLE_VARIABLES collection) that reads
    the variable's current value (a read-modify-write op, or an overwrite whose value depends on
    the variable).
    """

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], bool]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def is_training(self, graph: Any, fetches: Any) -> bool:
        import tensorflow as tf

        try:
            flat = tf.nest.flatten(fetches)
            elems = [graph.as_graph_element(f, allow_tensor=True, allow_operation=True) for f in flat]
            ops = [e if isinstance(e, tf.Operation) else e.op for e in elems]
        except Exception:  # noqa: BLE001 - odd fetch types: not something we can classify
            return False
        key = tuple(sorted(op.name for op in ops))
        with self._lock:
            per_graph = self._cache.setdefault(graph, {})
            hit = per_graph.get(key)
        if hit is None:
            trainable = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
            hit = _reaches_update(ops, trainable)
            with self._lock:
                per_graph[key] = hit
        return hit


def _reaches_update(ops: list[Any], trainable: set[str]) -> bool:
    seen: set[str] = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if OPTIMIZER_KERNEL_RE.match(op.type):
            return True
        if op.type in READ_MODIFY_WRITE_OPS or op.type in OVERWRITE_OPS:
            target = _written_variable(op)
            if target is not None and target in trainable and (
                    op.type in READ_MODIFY_WRITE_OPS or _depends_on(op.inputs[1:], target)):
                return True
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False


def _written_variable(op: Any) -> str | None:
    """Name of the variable op (VarHandleOp / VariableV2) a write op writes, if it can be traced."""
    if not op.inputs:
        return None
    t = op.inputs[0]
    for _ in range(64):
        if t.op.type in VARIABLE_OPS:
            return str(t.op.name)
        if t.op.type not in _HANDLE_PASS_THROUGH or not t.op.inputs:
            return None
        t = t.op.inputs[0]
    return None


def _depends_on(values: Any, variable: str) -> bool:
    seen: set[str] = set()
    stack = [t.op for t in values]
    while stack:
        op = stack.pop()
        if op.name == variable:
            return True
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False


def _no_tracker() -> StepTracker | None:
    return None


_tracker: Callable[[], StepTracker | None] = _no_tracker  # activation.active_steps once registered


# --- Keras ---------------------------------------------------------------------------------------

@functools.cache
def _callback_class(base: type) -> type:
    class AntmanCallback(base):  # type: ignore[misc, valid-type]
        """Times each training batch; evaluation/predict batches are not steps."""

        _tf_antman_callback = True

        def __init__(self, steps: StepTracker) -> None:
            super().__init__()
            self._steps = steps
            self._t0 = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._steps.step_end(time.perf_counter() - self._t0, training=True)

        # What tf_keras's CallbackList asks of every callback (Keras 3's Callback has none of
        # these): with them, either class works in either Keras's fit.
        def _implements_train_batch_hooks(self) -> bool:
            return True

        def _implements_test_batch_hooks(self) -> bool:
            return False

        def _implements_predict_batch_hooks(self) -> bool:
            return False

    return AntmanCallback


def _keras3_callback_base() -> type:
    from keras.src.callbacks.callback import Callback

    return Callback


def _tf_keras_callback_base() -> type:
    from tf_keras.src.callbacks import Callback

    return Callback


def legacy_keras() -> bool:
    """Whether `tf.keras` is tf_keras, as TensorFlow decides it (TF_USE_LEGACY_KERAS)."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")


def _is_tf_keras_model(model: Any) -> bool:
    return any(c.__module__.split(".")[0] == "tf_keras" for c in type(model).__mro__)


def keras_callback(steps: StepTracker, legacy: bool | None = None, model: Any = None) -> Any:
    """The callback `fit` gets automatically, for code that builds its own callback list.

    Its base class is the Callback of the Keras it will be used with: `model`'s Keras when given;
    else `legacy` (True: tf_keras); else tf_keras when `tf.keras` is tf_keras
    (TF_USE_LEGACY_KERAS=1) or when the script imported tf_keras and not Keras 3. Either class
    also works in the other Keras's fit (`AntmanCallback` carries what tf_keras asks of a callback).
    """
    if model is not None:
        use_tf_keras = _is_tf_keras_model(model)
    elif legacy is not None:
        use_tf_keras = legacy
    else:
        use_tf_keras = legacy_keras() or (
            "tf_keras" in sys.modules and KERAS3_TRAINER[0] not in sys.modules)
    base = _tf_keras_callback_base() if use_tf_keras else _keras3_callback_base()
    return _callback_class(base)(steps)


def _wrap_fit(fit: Callable[..., Any], callback_base: Callable[[], type]) -> Callable[..., Any]:
    signature = inspect.signature(fit)
    warned: list[bool] = []

    @functools.wraps(fit)
    def fit_with_antman(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps = _tracker()
        if steps is None or inside_marked_step():
            return fit(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return fit(self, *args, **kwargs)  # the caller's mistake: Keras reports it
        callbacks = bound.arguments.get("callbacks")
        if callbacks is None or isinstance(callbacks, (list, tuple)):
            callbacks = list(callbacks or [])
            if not any(getattr(c, _CALLBACK_MARK, False) for c in callbacks):
                callbacks.append(_callback_class(callback_base())(steps))
            bound.arguments["callbacks"] = callbacks
        elif not warned:
            warned.append(True)
            log.warning("fit() got callbacks=%s, not a list: add tf_antman.keras_callback() to it "
                        "or training steps are not seen", type(callbacks).__name__)
        with marked_step():
            return fit(*bound.args, **bound.kwargs)

    setattr(fit_with_antman, _MARK, True)
    return fit_with_antman


def _wrap_train_on_batch(train_on_batch: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(train_on_batch)
    def train_on_batch_with_antman(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps = _tracker()
        if steps is None or inside_marked_step():
            return train_on_batch(self, *args, **kwargs)
        t0 = time.perf_counter()
        with marked_step():
            out = train_on_batch(self, *args, **kwargs)
        steps.step_end(time.perf_counter() - t0, training=True)
        return out

    setattr(train_on_batch_with_antman, _MARK, True)
    return train_on_batch_with_antman


def _patch_model_class(cls: type, callback_base: Callable[[], type], what: str) -> None:
    for name, wrap in (("fit", lambda f: _wrap_fit(f, callback_base)), ("train_on_batch", _wrap_train_on_batch)):
        method = cls.__dict__.get(name)
        if method is None or getattr(method, _MARK, False):
            continue
        setattr(cls, name, wrap(method))
    log.debug("step hooks installed on %s fit/train_on_batch", what)


def _patch_keras3(module: ModuleType) -> None:
    _patch_model_class(getattr(module, KERAS3_TRAINER[1]), _keras3_callback_base, "Keras 3")


def _patch_tf_keras(module: ModuleType) -> None:
    _patch_model_class(module.Model, _tf_keras_callback_base, f"tf_keras ({module.__name__})")


# --- Session -------------------------------------------------------------------------------------

def _patch_session(module: ModuleType) -> None:
    base = module.BaseSession
    run = base.run
    make_callable = base.make_callable
    if getattr(run, _MARK, False):
        return
    fetches_cache = TrainingFetches()

    @functools.wraps(run)
    def run_with_antman(self: Any, fetches: Any, *args: Any, **kwargs: Any) -> Any:
        steps = _tracker()
        if steps is None or inside_marked_step():
            return run(self, fetches, *args, **kwargs)
        t0 = time.perf_counter()
        out = run(self, fetches, *args, **kwargs)
        if fetches_cache.is_training(self.graph, fetches):
            steps.step_end(time.perf_counter() - t0, training=True)
        return out

    @functools.wraps(make_callable)
    def make_callable_with_antman(self: Any, fetches: Any, feed_list: Any = None,
                                  accept_options: bool = False) -> Any:
        fn = make_callable(self, fetches, feed_list, accept_options)
        # With a feed list TF's callable goes through self.run, which counts it already.
        if feed_list is not None or _tracker() is None or not fetches_cache.is_training(self.graph, fetches):
            return fn

        @functools.wraps(fn)
        def training_callable(*args: Any, **kwargs: Any) -> Any:
            steps = _tracker()
            if steps is None or inside_marked_step():
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            steps.step_end(time.perf_counter() - t0, training=True)
            return out

        return training_callable

    for wrapped in (run_with_antman, make_callable_with_antman):
        setattr(wrapped, _MARK, True)
    base.run = run_with_antman
    base.make_callable = make_callable_with_antman
    log.debug("step hooks installed on Session.run/make_callable")


_registered = False


def register_import_hooks(active_steps: Callable[[], StepTracker | None]) -> None:
    """Patches each defining module once it has been imported completely (at once if it is);
    the patches find the step tracker through `active_steps` at call time."""
    global _registered, _tracker
    _tracker = active_steps
    if _registered:
        return
    _registered = True
    targets: list[tuple[str, Callable[[ModuleType], None]]] = [
        (SESSION_MODULE, _patch_session),
        (KERAS3_TRAINER[0], _patch_keras3),
        *((name, _patch_tf_keras) for name, _cls in TF_KERAS_MODELS),
    ]
    for name, patch in targets:
        if not importhook.on_import(name, after=_guarded(patch)):
            log.warning("%s is being imported right now: its step hooks cannot be installed; "
                        "enable tf-antman before importing TensorFlow or Keras", name)


def _guarded(patch: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def run(module: ModuleType) -> None:
        try:
            patch(module)
        except Exception:  # noqa: BLE001 - a Keras/TF version we do not know must still import
            log.exception("installing step hooks on %s failed; steps there are not seen", module.__name__)

    return run
