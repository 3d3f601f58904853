"""Narrow fixes that make Keras 3 `fit`/`evaluate`/`predict` work with several replicas.

Keras 3 (tested: `TESTED_KERAS`, on TensorFlow 2.18 to 2.21: `distrib_tf.versions`; no
fix needs a gate by TensorFlow version there) on TensorFlow breaks under
`MultiWorkerMirroredStrategy` in ways tf_keras did not (keras-team/keras#20585):

1. `_maybe_symbolic_build` takes the first batch from the training iterator and
   averages it with `strategy.reduce`, which cannot take a structure of `PerReplica`
   values across workers; and the batch it takes is lost to training (under any
   strategy), so the first step trains on the data's second batch. Fixed by building
   from zeros shaped like one replica's batch (the iterator's `element_spec`): only
   shapes and types matter, and no data is consumed. A dimension the spec leaves unknown
   is the one the model declares for that input (a Functional or Sequential model's
   `inputs`), else 1: `timeseries_dataset_from_array` leaves the window's length unknown,
   and a 1 there failed keras.io's weather forecast ("expected shape=(None, 48, 3), found
   shape=(1, 1, 3)"). A model with no `call` (keras.io's DCGAN: a discriminator, a
   generator and its own `train_step`) cannot be built from a batch, and Keras's build
   under a strategy raises "Unable to automatically build the model" where Keras with no
   strategy trains it: only `model.optimizer` is built, as that build would, and the
   `train_step` builds the rest when traced, as with no strategy.
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
12. An optimizer the model holds besides `model.optimizer` (keras.io's GANs: one for the
   discriminator, one for the generator) is built by Keras at its first `apply_gradients`,
   inside the traced step: with several replicas in one process (`MirroredStrategy`) its
   variables are then made in a replica's thread, and the step fails ("You must feed a
   value for placeholder tensor"; one replica a worker builds it well). Fixed there by
   building it once, in a `merge_call`
   out of the traced function (`tf.init_scope`), on the variables it is applied to,
   where Keras builds `model.optimizer` (fix 1); its `apply_gradients` then runs as before.
13. `gradient_accumulation_steps=k` fails at the first step under `MirroredStrategy` and
   `MultiWorkerMirroredStrategy` (a RuntimeError: `BaseOptimizer._backend_apply_gradients`
   calls `merge_call` inside its own `cond`). Fixed by all-reducing each step's gradients
   and taking their mean with the accumulators' outside any `cond`, then, in one merge call,
   each variable's update takes Keras's branch on its device: the accumulators hold the sum
   of the all-reduced gradients (one value on every replica), every k-th step applies their
   mean, clipped and with weight decay, as Keras does on one device. And `iterations` then
   moves once per k batches (`_iterations // k`): `batches_taken` reads the optimizer's
   own count of batches, which every step counter of distrib_tf counts.

Each fix changes behaviour only in the case it names and otherwise calls the original.
Their code is `distrib_tf.keras.compat_fixes`, each `fix(original, *args)` in the order
above; `apply()` installs them once per process; `make_strategy()` calls it for every
strategy it builds (fixes 1 and 7 matter on one device too). Other Keras versions get
a warning and no fixes.
"""

import contextlib
import functools
import logging

import keras

from distrib_tf.keras import compat_fixes as fixes

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
            (_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", fixes.maybe_symbolic_build)
        ],
        "reduce_per_replica": [(_tf_trainer, "reduce_per_replica", fixes.reduce_per_replica)],
        "compile_checks": [(_base_trainer.Trainer, "compile", fixes.compile_checked)],
        "model_checkpoint": [(callbacks.ModelCheckpoint, "_save_model", fixes.chief_only)],
        "backup_and_restore": [(callbacks.BackupAndRestore, "_save_model", fixes.chief_only)],
        "backup_and_restore_end": [(callbacks.BackupAndRestore, "on_train_end", fixes.chief_only)],
        "sum_duplicate_rows": [
            (_base_optimizer.BaseOptimizer, "apply", fixes.densify_where_cheaper),
            (_tf_optimizer.TFOptimizer, "_distributed_tf_update_step", fixes.update_with_summed_rows)],
        "iterator_release": [
            (_tf_trainer.TFEpochIterator, "reset", fixes.reset_off_the_main_thread),
            (_tf_trainer.TFEpochIterator, "__init__", fixes.track_iterator),
            (_tf_trainer.TensorFlowTrainer, "fit", fixes.release_iterators_after),
            (_tf_trainer.TensorFlowTrainer, "evaluate", fixes.release_iterators_after),
            (_tf_trainer.TensorFlowTrainer, "predict", fixes.release_iterators_after),
        ],
        "loss_scale": [
            (keras.optimizers.LossScaleOptimizer, "check_finite", fixes.check_finite_everywhere),
            (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads", fixes.count_skipped_step),
        ],
        "trace_then_meet": [(_tf_trainer.TensorFlowTrainer, "_make_function", fixes.trace_then_meet)],
        "meet_before_reset": [(_base_trainer.Trainer, "reset_metrics", fixes.meet_before_reset)],
        "saving_outside_scope": [(_saving_lib, "get_attr_skipset", fixes.skipset_outside_scopes)],
        "build_across_replicas": [
            (_base_optimizer.BaseOptimizer, "apply_gradients", fixes.build_across_replicas)],
        "accumulate_reduced": [
            (_base_optimizer.BaseOptimizer, "_backend_apply_gradients", fixes.accumulate_reduced)],
        "tensorboard": [
            (callbacks.TensorBoard, "set_model", fixes.tensorboard_set_model),
            (callbacks.TensorBoard, "on_train_end", fixes.tensorboard_on_train_end),
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


@contextlib.contextmanager
def reverted(name: str):
    """Inside, one fix (by its `_fixes()` name) is not installed, to show what it changes (plain
    Keras, once a run in the process installed the fixes); as it was on leaving."""
    installed = [(owner, attribute, fix) for owner, attribute, fix in _fixes()[name]
                 if hasattr(getattr(owner, attribute), "__distrib_tf_original__")]
    for owner, attribute, _ in installed:
        setattr(owner, attribute, getattr(owner, attribute).__distrib_tf_original__)
    try:
        yield
    finally:
        for owner, attribute, fix in installed:
            _patch(owner, attribute, fix)


def batches_taken(optimizer):
    """The variable that counts the batches `optimizer` took (fix 13): its `iterations`
    unless it accumulates gradients (then `iterations` is that count over k); a
    `LossScaleOptimizer`'s inner optimizer's."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(optimizer, "gradient_accumulation_steps", None) and is_tested_version():
        return optimizer._iterations  # pylint: disable=protected-access
    return optimizer.iterations


def built_on(optimizer) -> list:
    """The variables `optimizer` was built on (Keras keeps them, in the order its slots were
    made, as `_trainable_variables`); a `LossScaleOptimizer`'s inner optimizer's."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    return list(optimizer._trainable_variables)  # pylint: disable=protected-access


def _patch(owner, name, fix):
    original = getattr(owner, name)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return fix(original, *args, **kwargs)

    patched.__distrib_tf_original__ = original
    setattr(owner, name, patched)
