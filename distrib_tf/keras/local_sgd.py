"""Communicate less: periodic weight averaging (local SGD), and gradients in fewer bits.

Synchronous training all-reduces every gradient at every step. Where the link, not the
compute, sets the pace, two things help, both for any Keras model under a strategy from
`make_strategy()`:

**Periodic averaging** (`PeriodicSync`; the main job's `--sync=every:N` or `epoch`).
Each replica applies its own gradient: the optimizer's gradient all-reduce is skipped,
and the gradient is scaled back to the replica's own mean (Keras divides each replica's
loss by the number of replicas). The replicas' weights drift apart; every N steps (with
`--sync=epoch`, every epoch's last step), and once when `fit` starts and ends, one
all-reduce averages every weight of the model, BatchNormalization's moving statistics
included. The outer step then sets the new weights (Lin et al. 2018; DiLoCo, Douillard
et al. 2023):

- `average`: the average itself;
- `nesterov`: DiLoCo's outer step. With `anchor` the weights of the last sync and
  `delta = anchor - average` the outer gradient: `m = momentum * m + delta`, then
  `anchor -= rate * (delta + momentum * m)`. Rate 1 and momentum 0 is the average.

Each replica keeps its own optimizer state (Adam's moments), as in DiLoCo; the step
counts are equal anyway. The outer momentum lives in memory: a resumed job starts it
from zero, after one average that makes every worker's weights equal again. With plain
SGD, `every=1` and `average` equal synchronous training (the mean of `w - lr * g_i` is
`w - lr * mean(g_i)`); with momentum or Adam they do not, since each replica's optimizer
state follows its own gradients.

**Compressed all-reduce** (`compress_gradients`; `--allreduce_dtype=bfloat16|float16`).
Gradients travel in that type and are reduced back to the variables' type, in the one
place Keras 3 all-reduces them (`_all_reduce_sum_gradients` of its TensorFlow optimizer).
Under `mixed_float16`, gradients reach that place unscaled; `float16` multiplies them by
the loss scale for the trip and divides after, so that small gradients do not flush to 0.

Example, a Keras user's own model:

    >>> strategy = distrib_tf.make_strategy()
    >>> with strategy.scope():
    ...     model = ...; model.compile(...)
    >>> model.fit(dataset, callbacks=[PeriodicSync(strategy, every=64)])
"""

import functools
import weakref

import keras
import numpy as np
import tensorflow as tf

from distrib_tf.keras import compat
from distrib_tf.keras import steps as steps_lib

# What distrib_tf asks of each optimizer's gradient all-reduce, beside the optimizer (nothing
# of it is written to the optimizer): "mode" ("local", a dtype name), "clock" (a float64
# variable adding up all-reduce waits), "rider" (what else travels in its gradients' pack).
_ASKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _asked(optimizer, key: str):
    """What `optimizer`'s all-reduce is asked for `key`, or `None`."""
    return _ASKED.get(optimizer, {}).get(key)


def _ask(optimizer, key: str, value) -> None:
    """Asks `optimizer`'s all-reduce (and a LossScaleOptimizer's inner one's) for `key`;
    `None` takes it back."""
    for each in _inner_optimizers(optimizer):
        if value is None:
            _ASKED.get(each, {}).pop(key, None)
        else:
            _ASKED.setdefault(each, {})[key] = value


def release(optimizer) -> None:
    """Takes back everything asked of `optimizer`'s all-reduce: it all-reduces its gradients
    as Keras does, from its next trace on (a `Run.fit` ends with it)."""
    for each in _inner_optimizers(optimizer):
        _ASKED.pop(each, None)


class UnsupportedKeras(RuntimeError):
    """Periodic sync and compressed gradients need a tested Keras: they patch its internals."""


def _install(required: bool = True) -> bool:
    """Patches the TensorFlow optimizer's gradient all-reduce once per process.

    On a Keras distrib_tf was not tested with, patches nothing: raises `UnsupportedKeras`
    when `required`, else returns False (the step timing then goes without).
    """
    if not compat.is_tested_version():
        if not required:
            return False
        low, high = (".".join(map(str, v)) for v in compat.TESTED_KERAS)
        raise UnsupportedKeras(f"Keras {keras.__version__} is not a version distrib_tf was tested with "
                               f"({low} to {high}.x): periodic sync and compressed gradients patch its "
                               "optimizer's gradient all-reduce and are not available on it.")
    from keras.src.backend.tensorflow import optimizer as _tf_optimizer  # pylint: disable=import-outside-toplevel
    owner = _tf_optimizer.TFOptimizer
    if getattr(owner._all_reduce_sum_gradients, "__distrib_tf_original__", None):  # pylint: disable=protected-access
        return True
    keras_all_reduce = owner._all_reduce_sum_gradients  # pylint: disable=protected-access

    def original(self, grads_and_vars):
        # Last layers first: their gradients are ready first in the backward pass, and
        # TensorFlow launches a step's all-reduce packs in the order given (with
        # `bytes_per_pack`, a pack can then travel while earlier layers still compute).
        return keras_all_reduce(self, grads_and_vars[::-1])[::-1]

    def reduce(self, grads_and_vars):
        mode = _asked(self, "mode")
        if mode is None:
            return original(self, grads_and_vars)
        if mode == "local":  # Undo Keras's division of each replica's loss by the replica count.
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            return [(_map_values(g, lambda x: x * replicas), v) for g, v in grads_and_vars]
        narrow = [(_map_values(g, lambda x: tf.cast(x, mode)), v) for g, v in grads_and_vars]
        return [(_map_values(g, lambda x, v=v: tf.cast(x, v.dtype)), v) for g, v in original(self, narrow)]

    @functools.wraps(keras_all_reduce)
    def all_reduce_sum_gradients(self, grads_and_vars):
        if tf.distribute.get_replica_context() is None:
            return keras_all_reduce(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        clock = _asked(self, "clock")
        rider = _asked(self, "rider") if _asked(self, "mode") is None else None
        cargo = rider.board(grads_and_vars) if rider is not None else None
        reduced = reduce(self, grads_and_vars + ([(cargo, None)] if cargo is not None else []))
        if cargo is not None:
            rider.alight(reduced.pop()[0])
        if clock is not None:
            _time_wait(clock, grads_and_vars, reduced)
        return reduced

    all_reduce_sum_gradients.__distrib_tf_original__ = keras_all_reduce
    owner._all_reduce_sum_gradients = all_reduce_sum_gradients  # pylint: disable=protected-access
    return True


def _map_values(gradient, function):
    """`function` of a gradient's values; an embedding's (`tf.IndexedSlices`) stays sparse."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(function(gradient.values), gradient.indices, gradient.dense_shape)
    return function(gradient)


def _time_wait(clock, local, reduced) -> None:
    """Adds to `clock` the seconds from the last local gradient to the last reduced one.

    Two clock reads (`tf.timestamp`, a CPU kernel) and an add, beside the step: nothing
    in the step depends on them, so they add no barrier and no host round trip.
    """
    def tensors(pairs):
        return [getattr(g, "values", g) for g, _ in pairs if g is not None]

    with tf.control_dependencies(tensors(local)):
        start = tf.timestamp()
    with tf.control_dependencies(tensors(reduced)):
        end = tf.timestamp()
    clock.assign_add(end - start)


def time_all_reduce(optimizer, clock) -> None:
    """Adds every step's wait on the gradient all-reduce to `clock` (a float64 variable).

    The wait runs from this replica's last gradient to its last reduced gradient;
    `None` stops the timing. On a Keras distrib_tf was not tested with, nothing is timed
    (`clock` stays 0). Used by `distrib_tf.keras.progress` to tell a worker's own
    step time from the time it spent waiting for the others.
    """
    if not _install(required=False):
        return
    _ask(optimizer, "clock", clock)


def carry_with_gradients(optimizer, rider) -> bool:
    """Makes `rider` travel in `optimizer`'s gradient all-reduce: at each traced all-reduce
    of full-width gradients, `rider.board(grads_and_vars)` returns a 1-D tensor of the
    gradients' type, or `None`; it joins their pack, and `rider.alight(sum)` gets its sum
    over every replica. Compressed or skipped all-reduces (periodic sync) carry nothing.
    Returns False on a Keras distrib_tf was not tested with (nothing is carried)."""
    if not _install(required=False):
        return False
    _ask(optimizer, "rider", rider)
    return True


def _inner_optimizers(optimizer):
    """The optimizer that all-reduces: the one inside a LossScaleOptimizer, else itself."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer, inner] if inner is not None else [optimizer]


def compress_gradients(optimizer, dtype: str) -> None:
    """Makes `optimizer` all-reduce gradients in `dtype` (`"float32"` restores it)."""
    if dtype == "float32" and not any(_asked(each, "mode") for each in _inner_optimizers(optimizer)):
        return
    if dtype == "float16" and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "Invalid value for argument `dtype`. Received: dtype='float16' for a "
            "LossScaleOptimizer. Expected 'bfloat16' or 'float32': its loss-scaled gradients, "
            "summed in float16 after its finite check, can overflow where nothing sees it.")
    _install()
    _ask(optimizer, "mode", None if dtype == "float32" else dtype)


class PeriodicSync(keras.callbacks.Callback):
    """Local SGD: each replica applies its own gradients; every `every` steps, average.

    Args:
        strategy: the strategy the model was built under.
        every: steps between averages (counted by `steps`, so a resumed run keeps the
            schedule; an execution of several steps that passes a multiple averages at its end).
        outer: `"average"` or `"nesterov"` (DiLoCo's outer step).
        outer_learning_rate, outer_momentum: the outer step's, for `"nesterov"`.
        last_step: the step (of `steps`) that ends training, where the last average comes
            (before that step's backup); `None`: at the end of each `fit`.
        average_first: average once when training begins, so that workers resumed from
            backups that are not their own start equal. A run resumed from each worker's
            own backup goes on from its own weights, as the uninterrupted run did.
        steps: the stage's step counter (`distrib_tf.keras.steps`); default: the optimizer's.

    After each sync, `syncs` counts them and `bytes_per_worker` adds what a ring
    all-reduce of the weights sends from each worker (2 (n-1)/n of their bytes).
    """

    def __init__(self, strategy, every: int, *, outer: str = "average", outer_learning_rate: float = 1.0,
                 outer_momentum: float = 0.0, last_step: int | None = None, average_first: bool = True,
                 steps: steps_lib.StageSteps | None = None):
        super().__init__()
        if every < 1:
            raise ValueError(f"Invalid value for `every`. Received: {every}. Expected a positive integer.")
        if outer not in ("average", "nesterov"):
            raise ValueError(f"Invalid value for `outer`. Received: {outer!r}. Expected 'average' or 'nesterov'.")
        self.strategy, self.every, self.outer = strategy, every, outer
        self.rate, self.momentum = outer_learning_rate, outer_momentum
        self.syncs, self.bytes_per_worker = 0, 0
        self.last_step, self.average_first = last_step, average_first
        self.steps, self._step = steps or steps_lib.StageSteps(), 0
        self._average_fn = self._anchor = self._velocity = None

    def set_model(self, model):
        super().set_model(model)
        _install()
        _ask(model.optimizer, "mode", "local")

    def _averaged(self) -> list[np.ndarray]:
        """Every weight of the model averaged over all replicas (one all-reduce)."""
        weights = self.model.weights
        if self._average_fn is None:
            shapes = [tuple(w.shape) for w in weights]
            # The widest of the weights' types: float64 weights are averaged in float64.
            dtype = tf.float64 if any(tf.as_dtype(w.dtype) == tf.float64 for w in weights) else tf.float32
            self._bytes_per_element = dtype.size

            @tf.function
            def average():
                def replica_fn():
                    flat = tf.concat([tf.reshape(tf.cast(w.value, dtype), [-1]) for w in weights], 0)
                    return tf.distribute.get_replica_context().all_reduce("MEAN", flat)
                return self.strategy.run(replica_fn)

            self._average_fn, self._shapes = average, shapes
        flat = self.strategy.experimental_local_results(self._average_fn())[0].numpy()
        sizes = [int(np.prod(s)) for s in self._shapes]
        return [part.reshape(shape) for part, shape in zip(np.split(flat, np.cumsum(sizes)[:-1]), self._shapes)]

    def synchronize(self, outer_step: bool = True) -> None:
        """Averages the replicas' weights now and applies the outer step (if `outer_step`)."""
        averaged = self._averaged()
        trainable = {id(w) for w in self.model.trainable_weights}
        new = []
        for index, (weight, mean) in enumerate(zip(self.model.weights, averaged)):
            if outer_step and self.outer == "nesterov" and id(weight) in trainable:
                delta = self._anchor[index] - mean
                self._velocity[index] = self.momentum * self._velocity[index] + delta
                self._anchor[index] = self._anchor[index] - self.rate * (delta + self.momentum * self._velocity[index])
                mean = self._anchor[index]
            new.append(mean)
        for weight, value in zip(self.model.weights, new):
            weight.assign(value.astype(weight.dtype))
        replicas = self.strategy.num_replicas_in_sync
        self.syncs += 1
        self.bytes_per_worker += int(sum(v.size for v in averaged) * self._bytes_per_element * 2 * (replicas - 1)
                                     / max(replicas, 1))

    def on_train_begin(self, logs=None):
        if self.average_first:  # Once: a later `fit` of the same training goes on from here.
            self.synchronize(outer_step=False)
            self.average_first = False
        if self._anchor is None:
            self._anchor = [np.array(w.numpy(), copy=True) for w in self.model.weights]
            self._velocity = [np.zeros_like(a) for a in self._anchor]
        self._step = self.steps(self.model)

    def on_train_batch_end(self, batch, logs=None):
        before, step = self._step, self.steps(self.model)
        self._step = step
        if steps_lib.crossed(before, step, self.every) or step == self.last_step:
            self.synchronize()

    def on_train_end(self, logs=None):
        step = self.steps(self.model)
        if step % self.every and step != self.last_step and (self.last_step is None or self.model.stop_training):
            self.synchronize()  # Ended early (a callback stopped it): the workers end equal.
