"""Keras's input forms through a live `distrib_tf.Run` (issue 60, items 5 and 6): each trains
as in plain Keras in one process (same seed, no shuffle: the same weights bit for bit, the
same iterations and History); a PyDataset is reshuffled each epoch by the run's seed."""

import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

import distrib_tf

ROWS, CLASSES = 96, 3
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, 5)).astype("float32")
Y = X[:, :CLASSES].argmax(axis=1).astype("int64")
WEIGHTS = {0: 1.0, 1: 2.0, 2: 0.5}


@pytest.fixture(autouse=True)
def _sigterm_as_it_was():
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


class _Batches(keras.utils.PyDataset):
    """Batches of 16 rows by index; records `(epochs ended, index)` of each batch read."""

    def __init__(self, x=X, y=Y, size=16):
        super().__init__()
        self.x, self.y, self.size, self.read, self.ended = x, y, size, [], 0

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        self.read.append((self.ended, index))
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.ended += 1


def _dataset(x=X, y=Y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def _generator(x=X, y=Y):
    """Keras's usual generator: endless, its batches in order."""
    while True:
        for start in range(0, len(x), 16):
            yield x[start:start + 16], y[start:start + 16]


def _tfrecord(path):
    if not path.exists():
        _write_records(path)
    spec = {"x": tf.io.FixedLenFeature([5], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}
    return lambda: tf.data.TFRecordDataset(str(path)).map(
        lambda record: (lambda e: (e["x"], e["y"]))(tf.io.parse_single_example(record, spec))).batch(16)


def _write_records(path):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for row, label in zip(X, Y):
            features = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=row)),
                        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


def _inputs(tmp_path, *, plain: bool):
    """What a Keras user writes, each a fit of a fresh compiled model on fresh data (a
    generator is made anew for each run). Plain Keras (TF backend) moves `iterations` once
    more at the end of each epoch of unknown length (the step that finds no batch: 7 for 6
    batches), so its Adam steps differ; its reference there is the same data, its length
    made known (`assert_cardinality`), which the run trains exactly."""
    known = (lambda d: d.apply(tf.data.experimental.assert_cardinality(6))) if plain else (lambda d: d)
    records = lambda: known(_tfrecord(tmp_path / "rows.tfrecord")())  # noqa: E731
    unknown = lambda: _dataset().unbatch().filter(lambda x, y: True).batch(16)  # noqa: E731
    filtered = lambda: known(unknown())  # noqa: E731
    from_generator = lambda: known(tf.data.Dataset.from_generator(  # noqa: E731
        lambda: ((x, y) for x, y in zip(X, Y)), output_signature=(
            tf.TensorSpec((5,), tf.float32), tf.TensorSpec((), tf.int64))).batch(16))
    return {
        "class_weight_with_a_dataset": lambda m: m.fit(_dataset(), epochs=2, class_weight=WEIGHTS, shuffle=False,
                                                       verbose=0),
        "class_weight_with_a_py_dataset": lambda m: m.fit(_Batches(), epochs=2, class_weight=WEIGHTS, shuffle=False,
                                                          verbose=0),
        "batch_size_with_a_dataset": lambda m: m.fit(_dataset(), batch_size=64, epochs=2, shuffle=False, verbose=0),
        "a_tfrecord_dataset": lambda m: m.fit(records(), epochs=2, shuffle=False, verbose=0),
        "a_filtered_dataset": lambda m: m.fit(filtered(), epochs=2, shuffle=False, verbose=0),
        "from_generator": lambda m: m.fit(from_generator(), epochs=2, shuffle=False, verbose=0),
        "unknown_length_with_steps_per_epoch": lambda m: m.fit(unknown(), epochs=2, steps_per_epoch=3,
                                                               shuffle=False, verbose=0),
        "unknown_length_validation_with_steps": lambda m: m.fit(
            X, Y, batch_size=32, epochs=3, validation_data=unknown(), validation_steps=2, shuffle=False, verbose=0),
        "a_python_generator": lambda m: m.fit(_generator(), epochs=3, steps_per_epoch=4, shuffle=False, verbose=0),
        "a_python_generator_validating": lambda m: m.fit(
            X, Y, batch_size=32, epochs=2, validation_data=_generator(X[:48], Y[:48]), validation_steps=2,
            shuffle=False, verbose=0),
    }


def _build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _outcome(fit):
    model = _build()
    history = fit(model)
    return model.get_weights(), int(model.optimizer.iterations.numpy()), history.history


@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # Plain Keras's, each epoch of unknown length.
def test_keras_input_forms_train_through_a_run_as_in_plain_keras(tmp_path, capsys):
    """Issue 60, item 5: each exited 2; now the same final weights bit for bit, the same
    optimizer iterations and the same History as plain Keras."""
    inputs = _inputs(tmp_path, plain=False)
    plain = {name: _outcome(fit) for name, fit in _inputs(tmp_path, plain=True).items()}
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        ours = {name: _outcome(fit) for name, fit in inputs.items()}
    finally:
        run.end()
    for name in inputs:
        (plain_weights, plain_iterations, plain_history), (weights, iterations, history) = plain[name], ours[name]
        assert iterations == plain_iterations, (name, iterations, plain_iterations)
        assert all(np.array_equal(a, b) for a, b in zip(weights, plain_weights)), name
        assert sorted(history) == sorted(plain_history), (name, history)
        for key, values in plain_history.items():
            np.testing.assert_array_equal(np.asarray(history[key]), np.asarray(values), err_msg=f"{name}: {key}")
    assert ours["a_tfrecord_dataset"][1] == 2 * 6 and ours["a_python_generator"][1] == 3 * 4
    said = capsys.readouterr().out
    assert said.count("chief:0: a tf.data.Dataset of unknown length: read once to count its 6 batches") == 3, said
    assert said.count("chief:0: a Python generator cannot be read twice") == 1, said
    assert said.count("chief:0: batch_size=64 ignored: x, a tf.data.Dataset, is batched already") == 1, said


@pytest.mark.parametrize("fit, said", [
    (lambda m: m.fit(_generator(), epochs=1), r"`steps_per_epoch`. Received: None with a Python generator"),
    (lambda m: m.fit(_generator(), epochs=1, steps_per_epoch=2, class_weight=WEIGHTS),
     r"`class_weight`. Received: class_weight='dict'. Expected None with x a generator"),
    (lambda m: m.fit(_dataset().repeat(), epochs=1), r"`x`. Received: a tf.data.Dataset of infinite length"),
    (lambda m: m.fit(_dataset(), epochs=1, class_weight=[1.0, 2.0]), r"`class_weight`.*a dict of class index"),
    (lambda m: m.fit(_dataset(), epochs=1, sample_weight=np.ones(ROWS)), r"`sample_weight`.*None with x a"),
    (lambda m: m.fit((b for b in [np.ones(3)]), epochs=1, steps_per_epoch=1), r"must return a tuple"),
], ids=["generator_without_steps", "generator_with_class_weight", "endless_dataset_without_steps",
        "class_weight_not_a_dict", "sample_weight_with_a_dataset", "generator_of_no_tuples"])
def test_invalid_keras_inputs_are_still_one_line(tmp_path, fit, said):
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        with pytest.raises(distrib_tf.run.InvalidRun, match=said):
            fit(_build())
    finally:
        run.end()


def _order(batches, steps, start=0):
    return [int(x[0, 0] // 16) for x, _ in batches.batches(start, True, seed=7).take(steps).as_numpy_iterator()]


def test_a_py_dataset_is_reshuffled_each_epoch_by_the_seed_and_replayed_at_any_step(tmp_path):
    """Issue 60, item 6: Keras reshuffles a PyDataset's batches each epoch under `fit(shuffle=True)`;
    through a run the order is a function of (seed, epoch): each epoch another permutation,
    the same on a rerun, and a resume at any step reads the uninterrupted run's batches."""
    rows = np.arange(ROWS * 5, dtype="float32").reshape(ROWS, 5) // 5  # Row i holds i: batch k starts 16k.
    batches = distrib_tf.data.from_py_dataset(_Batches(rows, Y))
    uninterrupted = _order(batches, 18)
    epochs = [uninterrupted[i:i + 6] for i in range(0, 18, 6)]
    assert all(sorted(epoch) == list(range(6)) for epoch in epochs) and len({tuple(e) for e in epochs}) == 3
    assert _order(distrib_tf.data.from_py_dataset(_Batches(rows, Y)), 10, start=8) == uninterrupted[8:]
    in_order = [int(x[0, 0] // 16) for x, _ in batches.batches(0, False).as_numpy_iterator()]
    assert in_order == list(range(6))  # shuffle=False: Keras's order.

    def fit(directory):
        run = distrib_tf.Run(directory, seed=3, exit_on_error=False)
        try:
            data, model = _Batches(), _build()
            model.fit(data, epochs=2, verbose=0)  # Keras's default shuffle=True.
        finally:
            run.end()
        read = data.read[1:]  # (Its batch 0 is read once first, to learn its shapes.)
        return [[i for e, i in read if e == epoch] for epoch in (0, 1)], model.get_weights()

    read, weights = fit(tmp_path / "first")
    assert sorted(read[0]) == sorted(read[1]) == list(range(6)) and read[0] != read[1], read
    again, weights_again = fit(tmp_path / "again")
    assert again == read and all(np.array_equal(a, b) for a, b in zip(weights, weights_again))
