"""Narrow fixes that make Keras 3 `fit`/`evaluate`/`predict` work with several replicas.

Keras 3 (tested: `TESTED_KERAS`, on TensorFlow 2.18 to 2.21: `distrib_tf.versions`; no
fix needs a gate by TensorFlow version there) on TensorFlow breaks under
`MultiWorkerMirroredStrategy` in ways tf_keras did not (keras-team/keras#20585):

1. `_maybe_symbolic_build` takes the first batch from the training iterator and
   averages it with `strategy.reduce`, which cannot take a structure of `PerReplica`
   values across workers; and the batch it takes is lost to training (under any
   strategy), so the first step trains on the data's second batch. Fixed by building
   from zeros shaped like one replica's batch (the iterator's `element_spec`): only
   shapes and types matter, and no data is consumed.
2. `reduce_per_replica` reduces logs with `strategy.reduce("MEAN", v, axis=0)`, which
   fails on scalar logs, and `strategy.reduce("SUM", v)` misses its `axis`. Fixed by
   reducing across replicas element-wise (`axis=None`), what both mean, and all the
   scalar logs of a step in one all-reduce (one vector per type) rather than one each.
3. `ModelCheckpoint` and `BackupAndRestore` write the same `.h5` files from every
   worker (an HDF5 lock error, then a dead peer). Saving in Keras 3 runs no
   collectives, so only the chief (`strategy.extended.should_checkpoint`) writes;
   the others skip the write. Every worker still restores from the backup. The same
   for `BackupAndRestore.on_train_end`, which deletes the backup (`delete_checkpoint`).
4. `steps_per_execution > 1` does not run under several replicas: refused at
   `compile` with a clear error.
5. `TensorBoard` writes every worker's events into one directory: non-chief workers
   write into a scratch directory that is removed when training ends.
6. `jit_compile=True` puts the cross-replica step inside XLA, which has no CPU
   collectives (the process aborts under several workers) and cannot span logical
   CPU devices: refused at `compile` when the replicas are on CPU.
7. An embedding's gradient is a `tf.IndexedSlices` with one row per token looked up,
   duplicates not summed; Keras's optimizers update such a gradient row by row, so
   Adam squares each duplicate before summing them, and the all-reduce of several
   replicas (an all-gather of their rows) adds more duplicates: results change with the
   number of replicas. Fixed by summing the rows of each index after the all-reduce, on
   every layout: the gradient stays sparse (only the rows looked up cross the network,
   and the optimizer gets its sparse update) and is the one dense Adam would see. Two
   cases are densified before the all-reduce, as this fix did for every gradient before:
   replicas of one process (`MirroredStrategy`, where a sparse gradient came out wrong
   under Keras's merge call and nothing crosses a network), and tables under
   `SPARSE_MIN_BYTES`, whose dense gradient travels in the one packed all-reduce while a
   sparse one costs three all-gathers of their own, each a round trip (about 5 ms here,
   which 1 Gbit/s spends on 0.6 MB).
8. `fit` validates every epoch through one `TFEpochIterator`, whose `reset` drops the
   previous epoch's dataset iterator on the main thread. Under `tf.distribute` that
   iterator feeds each replica through a per-device tf.data pipeline, whose destructor
   joins the pipeline's thread (in a debugger: `RootDataset::Iterator`'s destructor,
   joining while tf.data's autotuning thread sleeps), for seconds per epoch while the
   other workers wait at validation's first collective (BENCHMARKS.md). The same wait
   comes when `fit`, `evaluate` or `predict` returns and drops its iterators: measured 8.5 s
   between the last epoch's callbacks and `fit` returning, on every worker of the
   main job. Fixed by dropping them on a thread of their own, which the process waits
   for at exit; nothing else changes.
9. Each Keras step function is traced on its first call, whose collectives then start
   on a worker that traced fast while a slower one is still tracing: under a collective
   timeout (`make_strategy(timeout_seconds=S)`) a peer slow to trace, minutes for a large
   model, fails the job as a dead one would. Fixed under several workers by tracing the
   function first, then meeting every worker at a coordination-service barrier
   (`distrib_tf.keras.phases`), then running it; later calls run as before. The same
   barrier comes before `reset_metrics`, the first collectives of each epoch and of each
   `evaluate` (an assign to a metric's on-read variable reads it back across workers),
   which follow callbacks where the workers part: the chief saving, a thread letting go of
   an iterator (fix 8). Seen without it: worker:1 at an `evaluate`'s reset timed out
   after 10 s while the chief was still ending `fit`.
10. Keras's `LossScaleOptimizer` (float16) decides whether a step's gradients are finite
   from each replica's own, before the all-reduce, which its finite branch holds: an
   overflow on one replica sends it down the other branch, and the replicas wait for each
   other's collectives until a timeout (without one, forever); under a merge call the
   first replica decides for all, and an overflow elsewhere is applied. And a skipped step
   leaves `iterations` behind the batches taken, which resumes and schedules count on.
   Fixed under several replicas by all-reducing the flag (finite only where finite on
   every replica), and under any strategy by counting a skipped step in `iterations`,
   so that it counts the batches taken alike on every layout.
11. Keras's saving (`save_weights`, `save`, `ModelCheckpoint`) builds reference objects
   the first time it saves each kind of object (`saving_lib.get_attr_skipset`), among
   them an `Optimizer`, whose variables, made under a `MultiWorkerMirroredStrategy`
   scope, are broadcast from the chief to every worker. A chief-only save inside
   `strategy.scope()` (a `fit` called there, as in countless Keras scripts) then waits
   forever in that broadcast, which no other worker joins. Fixed by building them on a
   thread of their own, where no strategy scope is entered (scopes are per thread); the
   result is the same attribute names.

Each fix changes behaviour only in the case it names and otherwise calls the original.
`apply()` installs them once per process; `make_strategy()` calls it for every
strategy it builds (fixes 1 and 7 matter on one device too). Other Keras versions get
a warning and no fixes.
"""

import functools
import inspect
import logging
import shutil
import tempfile
import threading

import keras
import tensorflow as tf

from distrib_tf.keras import phases

logger = logging.getLogger("distrib_tf")

# Inclusive (major, minor) range; every version in it passed tests/test_keras_compat.py.
TESTED_KERAS = ((3, 12), (3, 15))
_applied = _warned = False


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def is_tested_version() -> bool:
    low, high = TESTED_KERAS
    return low <= keras_version() <= high


def _private_modules():
    """The private Keras modules the fixes patch, imported only to apply them: a Keras that
    moved them still imports distrib_tf (and, untested, gets no fixes)."""
    # pylint: disable=import-outside-toplevel
    from keras.src.backend.tensorflow import optimizer
    from keras.src.backend.tensorflow import trainer
    from keras.src.optimizers import base_optimizer
    from keras.src.saving import saving_lib
    from keras.src.trainers import trainer as base_trainer
    return trainer, optimizer, base_optimizer, base_trainer, saving_lib


def _fixes():
    """Fix name to the `(owner, attribute, replacement)` triples it installs."""
    callbacks = keras.callbacks
    _tf_trainer, _tf_optimizer, _base_optimizer, _base_trainer, _saving_lib = _private_modules()
    return {
        "symbolic_build": [
            (_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", _maybe_symbolic_build)
        ],
        "reduce_per_replica": [(_tf_trainer, "reduce_per_replica", _reduce_per_replica)],
        "compile_checks": [(_base_trainer.Trainer, "compile", _compile)],
        "model_checkpoint": [(callbacks.ModelCheckpoint, "_save_model", _chief_only)],
        "backup_and_restore": [(callbacks.BackupAndRestore, "_save_model", _chief_only)],
        "backup_and_restore_end": [(callbacks.BackupAndRestore, "on_train_end", _chief_only)],
        "sum_duplicate_rows": [
            (_base_optimizer.BaseOptimizer, "apply", _densify_where_cheaper),
            (_tf_optimizer.TFOptimizer, "_distributed_tf_update_step", _sum_duplicate_rows)],
        "iterator_release": [
            (_tf_trainer.TFEpochIterator, "reset", _reset_off_the_main_thread),
            (_tf_trainer.TFEpochIterator, "__init__", _track_iterator),
            (_tf_trainer.TensorFlowTrainer, "fit", _release_iterators_after),
            (_tf_trainer.TensorFlowTrainer, "evaluate", _release_iterators_after),
            (_tf_trainer.TensorFlowTrainer, "predict", _release_iterators_after),
        ],
        "loss_scale": [
            (keras.optimizers.LossScaleOptimizer, "check_finite", _check_finite_everywhere),
            (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads", _count_skipped_step),
        ],
        "trace_then_meet": [(_tf_trainer.TensorFlowTrainer, "_make_function", _trace_then_meet)],
        "meet_before_reset": [(_base_trainer.Trainer, "reset_metrics", _meet_before_reset)],
        "saving_outside_scope": [(_saving_lib, "get_attr_skipset", _skipset_outside_scopes)],
        "tensorboard": [
            (callbacks.TensorBoard, "set_model", _tensorboard_set_model),
            (callbacks.TensorBoard, "on_train_end", _tensorboard_on_train_end),
        ],
    }


def apply() -> bool:
    """Installs every fix once per process; returns whether they are installed."""
    global _applied, _warned
    if _applied:
        return True
    if not is_tested_version():
        if _warned:
            return False
        _warned = True
        logger.warning(
            "Keras %s is not a version distrib_tf was tested with (%s to %s.x): its "
            "multi-replica fixes are not applied and fit() may fail under several workers.",
            keras.__version__, ".".join(map(str, TESTED_KERAS[0])), ".".join(map(str, TESTED_KERAS[1])),
        )
        return False
    for patches in _fixes().values():
        for owner, name, fix in patches:
            _patch(owner, name, fix)
    _applied = True
    return True


def revert(name: str) -> None:
    """Removes one installed fix (by its `_fixes()` name), to show it is needed."""
    for owner, attribute, _ in _fixes()[name]:
        original = getattr(owner, attribute).__distrib_tf_original__
        setattr(owner, attribute, original)


def _patch(owner, name, fix):
    original = getattr(owner, name)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return fix(original, *args, **kwargs)

    patched.__distrib_tf_original__ = original
    setattr(owner, name, patched)


def _is_chief(model) -> bool:
    return model.distribute_strategy.extended.should_checkpoint


# Fix 1.
def _maybe_symbolic_build(original, self, iterator=None, data_batch=None):
    if self._distribute_strategy is None or iterator is None:  # pylint: disable=protected-access
        return original(self, iterator=iterator, data_batch=data_batch)
    spec = iterator._distributed_dataset.element_spec  # pylint: disable=protected-access
    return original(self, data_batch=tf.nest.map_structure(_zeros_like_spec, spec))


def _zeros_like_spec(spec):
    """One replica's batch of zeros: the shapes and types are all a build needs."""
    if isinstance(spec, tf.distribute.DistributedValues) or hasattr(spec, "_value_specs"):
        spec = spec._value_specs[0]  # pylint: disable=protected-access
    return tf.zeros([1 if d is None else d for d in spec.shape], spec.dtype)


# Fix 2.
_LOGS_REDUCED = "_distrib_tf_logs_reduced"  # On a strategy, while its train step is traced.


def mark_logs_reduced(strategy, reduced: bool) -> None:
    """Tells fix 2 that the training step being traced returns its logs already reduced
    over the replicas (they travelled in the gradients' all-reduce: `distrib_tf.keras.step_logs`):
    `fit` then takes this worker's values as they are, with no collective of its own."""
    strategy.__dict__[_LOGS_REDUCED] = reduced


def _reduce_per_replica(original, values, strategy, reduction):
    if reduction == "auto" and strategy.__dict__.pop(_LOGS_REDUCED, False):
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], values)
    if reduction in ("auto", "mean", "sum") and phases.is_multi_worker(strategy):
        op = "SUM" if reduction == "sum" else "MEAN"
        return _reduce_packed(strategy, op, values)
    return original(values, strategy, reduction)


def _reduce_packed(strategy, op, values):
    """`strategy.reduce(op, v, axis=None)` for every `v` in `values`; scalars of one type
    travel in one vector, so a step's logs cost one all-reduce."""
    flat = tf.nest.flatten(values)
    reduced = list(flat)
    groups = {}  # (per replica?, dtype): positions of the scalars of that kind.
    for position, value in enumerate(flat):
        specs = getattr(value, "_value_specs", None)  # A PerReplica's; one local replica gives a tensor.
        spec = specs[0] if specs else (value if tf.is_tensor(value) else None)
        if spec is not None and spec.shape.rank == 0 and spec.dtype.is_floating:
            groups.setdefault((specs is not None, spec.dtype), []).append(position)
        else:
            reduced[position] = strategy.reduce(op, value, axis=None)
    for (per_replica, _), positions in groups.items():
        scalars = tuple(flat[p] for p in positions)
        packed = strategy.run(lambda *s: tf.stack(s), args=scalars) if per_replica else tf.stack(scalars)
        for position, value in zip(positions, tf.unstack(strategy.reduce(op, packed, axis=None))):
            reduced[position] = value
    return tf.nest.pack_sequence_as(values, reduced)


# Fixes 4 and 6.
def _compile(original, self, *args, **kwargs):
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    strategy = self.distribute_strategy
    steps = bound.arguments["steps_per_execution"]
    if strategy.num_replicas_in_sync > 1 and steps != 1:
        raise ValueError(
            "Invalid value for argument `steps_per_execution`. Received: "
            f"steps_per_execution={steps!r} under {type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas. Expected 1: Keras "
            f"{keras.__version__} cannot run several steps per execution on several "
            "replicas."
        )
    jit = bound.arguments["jit_compile"]
    if jit is True and strategy.num_replicas_in_sync > 1 and not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            "Invalid value for argument `jit_compile`. Received: jit_compile=True under "
            f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} CPU replicas. "
            "Expected False or 'auto': XLA cannot compile a step whose replicas or "
            "collectives span several CPU devices."
        )
    return original(self, *args, **kwargs)


# Fix 3.
def _chief_only(original, self, *args, **kwargs):
    if _is_chief(self.model):
        return original(self, *args, **kwargs)
    return None


# Fix 5.
def _tensorboard_set_model(original, self, model):
    if _is_chief(model):
        return original(self, model)
    log_dir = self.log_dir
    self._distrib_tf_scratch = self.log_dir = tempfile.mkdtemp(prefix="distrib_tf_tb_")  # pylint: disable=protected-access
    try:
        return original(self, model)
    finally:
        self.log_dir = log_dir


def _tensorboard_on_train_end(original, self, logs=None):
    try:
        return original(self, logs)
    finally:
        scratch = getattr(self, "_distrib_tf_scratch", None)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


# Fix 7.
SPARSE_MIN_BYTES = 1 << 20  # Smaller tables all-reduce their gradient dense.


def _densify_where_cheaper(original, self, grads, trainable_variables=None):
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        local = not phases.is_multi_worker(strategy)
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and (
            local or _dense_bytes(g) < SPARSE_MIN_BYTES) else g for g in grads]
    return original(self, grads, trainable_variables)


def _dense_bytes(gradient: tf.IndexedSlices) -> float:
    shape = tf.get_static_value(gradient.dense_shape)
    return float("inf") if shape is None else float(shape.prod()) * gradient.dtype.size


def _sum_duplicate_rows(original, self, distribution, grads_and_vars, learning_rate):
    grads_and_vars = [(sum_duplicate_rows(g) if isinstance(g, tf.IndexedSlices) else g, v)
                      for g, v in grads_and_vars]
    return original(self, distribution, grads_and_vars, learning_rate)


def sum_duplicate_rows(gradient: tf.IndexedSlices) -> tf.IndexedSlices:
    """`gradient` with one row per index, the sum of its rows there (still sparse)."""
    indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradient.dense_shape)


# Fix 8.
RELEASE_THREAD = "distrib_tf-iterator-release"


def _reset_off_the_main_thread(original, self):
    held = [self._current_iterator]  # pylint: disable=protected-access
    original(self)  # Keras lets go of it here; the list then holds the last reference.
    if held[0] is not None:
        # Not a daemon: Python waits for it at exit. A daemon thread still inside the
        # destructor when the interpreter shuts down aborts the process.
        threading.Thread(target=held.clear, name=RELEASE_THREAD).start()


_created_iterators = []  # The TFEpochIterators created inside the fit, evaluate or predict running.
_calls = [0]  # How many of those are running (evaluate runs inside fit).


def _track_iterator(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    if _calls[0]:  # One made elsewhere is its maker's to let go of.
        _created_iterators.append(self)


def _release_iterators_after(original, self, *args, **kwargs):
    start = len(_created_iterators)
    _calls[0] += 1
    try:
        return original(self, *args, **kwargs)
    finally:  # The call's frame is gone: the list holds the last references to its iterators.
        _calls[0] -= 1
        held = _created_iterators[start:]
        del _created_iterators[start:]
        if held:
            threading.Thread(target=held.clear, name=RELEASE_THREAD).start()


# Fix 9.
def _trace_then_meet(original, self, step_function):
    function = original(self, step_function)
    strategy = self.distribute_strategy
    if self.run_eagerly or not phases.is_multi_worker(strategy):
        return function
    traced = [cell.cell_contents for cell in function.__closure__ or ()
              if hasattr(cell.cell_contents, "get_concrete_function")]  # Keras's tf.function.
    met = []

    @functools.wraps(function)
    def meet_first(iterator):
        if not met:
            if isinstance(iterator, tf.distribute.DistributedIterator):
                for tf_function in traced:
                    tf_function.get_concrete_function(iterator)
            phases.enter(strategy, step_function.__name__)
            met.append(True)
        return function(iterator)

    return meet_first


def _meet_before_reset(original, self):
    # Each epoch of fit and each evaluate begins with it, after the callbacks (the chief's
    # saves): its assigns to the metrics' on-read variables are eager collectives.
    strategy = self.distribute_strategy
    if tf.executing_eagerly() and phases.is_multi_worker(strategy):
        phases.enter(strategy, "reset_metrics")
    return original(self)


# Fix 10.
def _check_finite_everywhere(original, self, grads):
    finite = original(self, grads)
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return finite
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync == 1:
        return finite
    not_finite = context.all_reduce("SUM", tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(not_finite, 0.0)


def _count_skipped_step(original, self):
    original(self)
    if tf.distribute.has_strategy():
        self.inner_optimizer.iterations.assign_add(1)


# Fix 11.
def _skipset_outside_scopes(original, obj_type):
    if not tf.distribute.has_strategy():
        return original(obj_type)
    from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel

    key = f"distrib_tf_saving_skipset_{obj_type}"  # In Keras's global state, per thread like its own cache.
    cached = global_state.get_global_attribute(key)
    if cached is not None:
        return cached
    found = []
    thread = threading.Thread(target=lambda: found.append(original(obj_type)), name="distrib_tf-saving")
    thread.start()
    thread.join()
    if not found:  # It raised on the thread (and printed there): raise it here, in the caller's scope.
        return original(obj_type)
    global_state.set_global_attribute(key, found[0])
    return found[0]
