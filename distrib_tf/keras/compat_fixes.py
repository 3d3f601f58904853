"""The Keras 3 fixes of `distrib_tf.keras.compat`, numbered as its docstring numbers them:
each `fix(original, self, ...)` stands in for one Keras attribute and calls `original`
outside the case it fixes. `compat` says which attribute each replaces and installs them."""

import functools
import inspect
import logging
import shutil
import tempfile
import threading

import keras
import tensorflow as tf
from tensorflow.python.data.util.structure import NoneTensorSpec

from distrib_tf.keras import phases

logger = logging.getLogger("distrib_tf")


def is_chief(model) -> bool:
    return model.distribute_strategy.extended.should_checkpoint


# Fix 1.
def maybe_symbolic_build(original, self, iterator=None, data_batch=None):
    if self._distribute_strategy is None:  # pylint: disable=protected-access
        return original(self, iterator=iterator, data_batch=data_batch)
    if type(self).call is keras.Model.call:
        return build_optimizer_only(self)
    if iterator is None:
        return original(self, iterator=iterator, data_batch=data_batch)
    spec = iterator._distributed_dataset.element_spec  # pylint: disable=protected-access
    flat = tf.nest.flatten(spec)
    zeros = [zeros_like_spec(s, d) for s, d in zip(flat, declared_input_shapes(self, spec))]
    return original(self, data_batch=tf.nest.pack_sequence_as(spec, zeros))


def build_optimizer_only(model) -> None:
    """A model with no `call` (keras.io's GANs) has nothing to build from: as Keras with no
    strategy, its own `train_step` builds what it uses when traced (fix 12 builds its other
    optimizers); `model.optimizer` is built here, on every trainable variable, as Keras's
    build under a strategy does."""
    if model.optimizer is not None and not model.optimizer.built:
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)


def declared_input_shapes(model, spec) -> list:
    """For each leaf of `spec` (an `(x, y, sample_weight)` batch's), the shape the model
    declares for that input (a Functional or Sequential model's `inputs`), else None: a
    dataset may leave a dimension unknown that the model knows (the window length of
    `timeseries_dataset_from_array`)."""
    x = spec[0] if isinstance(spec, tuple) and 1 <= len(spec) <= 3 else spec  # Keras's unpacking.
    try:
        inputs = list(model.inputs or ())
    except AttributeError:  # A Sequential with no input yet; a subclassed model declares none.
        inputs = []
    flat_x = tf.nest.flatten(x)
    if isinstance(x, dict) and len(flat_x) == len(x) and inputs and {i.name for i in inputs} <= x.keys():
        named = {i.name: tuple(i.shape) for i in inputs}  # Keras matches a dict's keys to input names.
        declared = [named.get(key) for key in sorted(x)]  # tf.nest's order.
    elif len(flat_x) == len(inputs):
        declared = [tuple(i.shape) for i in inputs]
    else:
        declared = [None] * len(flat_x)
    return declared + [None] * (len(tf.nest.flatten(spec)) - len(flat_x))


def zeros_like_spec(spec, declared=None):
    """One replica's batch of zeros: the shapes and types are all a build needs. A dimension
    `spec` leaves unknown is the model's `declared` one where it has one, else 1."""
    if isinstance(spec, tf.distribute.DistributedValues) or hasattr(spec, "_value_specs"):
        spec = spec._value_specs[0]  # pylint: disable=protected-access
    if isinstance(spec, NoneTensorSpec):  # An optional input passed as None.
        return None
    shape = spec.shape
    if declared is not None and shape.is_compatible_with(declared):
        shape = shape.merge_with(declared)
    zeros = tf.zeros([1 if d is None else d for d in shape], spec.dtype)
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensor.from_tensor(zeros, ragged_rank=spec.ragged_rank, row_splits_dtype=spec.row_splits_dtype)
    return zeros


# Fix 2.
_LOGS_REDUCED = "_distrib_tf_logs_reduced"  # On a strategy, while its train step is traced.


def mark_logs_reduced(strategy, reduced: bool) -> None:
    """Tells fix 2 that the training step being traced returns its logs already reduced
    over the replicas (they travelled in the gradients' all-reduce: `distrib_tf.keras.step_logs`):
    `fit` then takes this worker's values as they are, with no collective of its own."""
    strategy.__dict__[_LOGS_REDUCED] = reduced


def reduce_per_replica(original, values, strategy, reduction):
    if reduction == "auto" and strategy.__dict__.pop(_LOGS_REDUCED, False):
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], values)
    if reduction in ("auto", "mean", "sum") and phases.is_multi_worker(strategy):
        op = "SUM" if reduction == "sum" else "MEAN"
        return reduce_packed(strategy, op, values)
    return original(values, strategy, reduction)


def reduce_packed(strategy, op, values):
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
def compile_checked(original, self, *args, **kwargs):
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
def chief_only(original, self, *args, **kwargs):
    if is_chief(self.model):
        return original(self, *args, **kwargs)
    return None


# Fix 5.
def tensorboard_set_model(original, self, model):
    if is_chief(model):
        return original(self, model)
    log_dir = self.log_dir
    self._distrib_tf_scratch = self.log_dir = tempfile.mkdtemp(prefix="distrib_tf_tb_")  # pylint: disable=protected-access
    try:
        return original(self, model)
    finally:
        self.log_dir = log_dir


def tensorboard_on_train_end(original, self, logs=None):
    try:
        return original(self, logs)
    finally:
        scratch = getattr(self, "_distrib_tf_scratch", None)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


# Fix 7.
SPARSE_MIN_BYTES = 1 << 20  # Smaller tables all-reduce their gradient dense.


def densify_where_cheaper(original, self, grads, trainable_variables=None):
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        local = not phases.is_multi_worker(strategy)
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and (
            local or dense_bytes(g) < SPARSE_MIN_BYTES) else g for g in grads]
    return original(self, grads, trainable_variables)


def dense_bytes(gradient: tf.IndexedSlices) -> float:
    shape = tf.get_static_value(gradient.dense_shape)
    return float("inf") if shape is None else float(shape.prod()) * gradient.dtype.size


def update_with_summed_rows(original, self, distribution, grads_and_vars, learning_rate):
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


def reset_off_the_main_thread(original, self):
    held = [self._current_iterator]  # pylint: disable=protected-access
    original(self)  # Keras lets go of it here; the list then holds the last reference.
    if held[0] is not None:
        # Not a daemon: Python waits for it at exit. A daemon thread still inside the
        # destructor when the interpreter shuts down aborts the process.
        threading.Thread(target=held.clear, name=RELEASE_THREAD).start()


_created_iterators = []  # The TFEpochIterators created inside the fit, evaluate or predict running.
_calls = [0]  # How many of those are running (evaluate runs inside fit).


def track_iterator(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    if _calls[0]:  # One made elsewhere is its maker's to let go of.
        _created_iterators.append(self)


def release_iterators_after(original, self, *args, **kwargs):
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
def trace_then_meet(original, self, step_function):
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


def meet_before_reset(original, self):
    # Each epoch of fit and each evaluate begins with it, after the callbacks (the chief's
    # saves): its assigns to the metrics' on-read variables are eager collectives.
    strategy = self.distribute_strategy
    if tf.executing_eagerly() and phases.is_multi_worker(strategy):
        phases.enter(strategy, "reset_metrics")
    return original(self)


# Fix 10.
def check_finite_everywhere(original, self, grads):
    finite = original(self, grads)
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return finite
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync == 1:
        return finite
    not_finite = context.all_reduce("SUM", tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(not_finite, 0.0)


def count_skipped_step(original, self):
    original(self)
    if tf.distribute.has_strategy():
        self.inner_optimizer.iterations.assign_add(1)


# Fix 11.
def skipset_outside_scopes(original, obj_type):
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


# Fix 12.
def build_across_replicas(original, self, grads_and_vars):
    grads_and_vars = list(grads_and_vars)  # Often a zip: read once here.
    if not self.built and tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context() and len(
            tf.distribute.get_strategy().extended.worker_devices) > 1:  # Several replicas in this process.
        variables = [variable for _, variable in grads_and_vars]

        def build(_):
            with tf.init_scope():  # Out of the traced step, as Keras's own build of `model.optimizer`.
                self.build(variables)

        tf.distribute.get_replica_context().merge_call(build)
    return original(self, grads_and_vars)


# Fix 13.
def accumulate_reduced(original, self, grads, trainable_variables):
    strategy = tf.distribute.get_strategy()
    if (not self.gradient_accumulation_steps or not tf.distribute.has_strategy()
            or tf.distribute.in_cross_replica_context() or isinstance(strategy, tf.distribute.OneDeviceStrategy)):
        return original(self, grads, trainable_variables)
    # Keras's arithmetic (`BaseOptimizer._backend_apply_gradients`) on the all-reduced gradients:
    # the collective and the mean outside any `cond`, then one merge call, inside which each
    # variable's own update takes the branch (no synchronization point in it).
    reduced = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g, _ in
               self._all_reduce_sum_gradients(zip(grads, trainable_variables))]
    steps = self.gradient_accumulation_steps
    accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]
    means = self._clip_gradients([(g + a) / steps for g, a in zip(reduced, accumulators)])
    is_update_step = (self._iterations + 1) % steps == 0
    tf.__internal__.distribute.interim.maybe_merge_call(
        functools.partial(_apply_or_accumulate, self), strategy, list(zip(trainable_variables, accumulators)),
        reduced, means, self.learning_rate, is_update_step)
    if self.use_ema:  # As Keras's, after the update.
        self._update_model_variables_moving_average(self._trainable_variables)
        if self.ema_overwrite_frequency:
            tf.cond((self.iterations + 1) % self.ema_overwrite_frequency == 0,
                    lambda: self._overwrite_model_variables_with_average_value(self._trainable_variables),
                    lambda: None)


def _apply_or_accumulate(optimizer, distribution, pairs, reduced, means, learning_rate, is_update_step):
    """Each variable, on each device: Keras's update step with the mean of the accumulated
    gradients (weight decay first), the accumulator zeroed; or the gradient accumulated."""
    def update(var, grad, mean, rate, update_now, accumulator):
        def apply():
            if optimizer.weight_decay is not None and optimizer._use_weight_decay(var):
                var.assign_sub(var * tf.cast(optimizer.weight_decay, var.dtype) * tf.cast(rate, var.dtype))
            optimizer.update_step(mean, var, rate)
            optimizer.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

        def accumulate():
            optimizer.assign(accumulator, accumulator + grad)
        tf.cond(update_now, apply, accumulate)

    for (var, accumulator), grad, mean in zip(pairs, reduced, means):
        var = var.value if isinstance(var, keras.Variable) else var
        distribution.extended.update(var, update, args=(grad, mean, learning_rate, is_update_step),
                                     kwargs={"accumulator": accumulator}, group=False)
