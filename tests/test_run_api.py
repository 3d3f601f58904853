"""The run API in one process: any data of a user's, `fit` returning a History, `evaluate` and
`predict` after it, the saved model loaded by plain Keras, bad input in one line, exit 2."""

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import distrib_tf
from cluster_runner import finished_backups
from distrib_tf.keras import worker_backup
from distrib_tf.run import InvalidRun
from distrib_tf.run import schedules

ROOT = os.path.dirname(os.path.dirname(__file__))
sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import my_models  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _sigterm_as_it_was():
    """A Run takes SIGTERM (exit 75 from its `with` block): give pytest's back afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def test_fit_on_arrays_with_two_inputs_returns_a_history_and_the_model_loads_with_plain_keras(tmp_path):
    (tmp_path / "run").mkdir(mode=0o755)  # An existing model_dir: tightened (issue 33 item 8).
    (tmp_path / "run").chmod(0o755)
    run = distrib_tf.Run(tmp_path / "run", seed=0, backup_every_steps=4, exit_on_error=False)
    with run.strategy.scope():
        model = my_models.build(total_steps=32)
    x, y = my_models.arrays(256)
    train = distrib_tf.data.from_arrays(x, y)
    history = run.fit(model, train, epochs=2, global_batch_size=16,
                      validation_data=distrib_tf.data.from_arrays(*my_models.arrays(64, seed=1)), verbose=0)
    assert isinstance(history, keras.callbacks.History) and history.epoch == [0, 1]
    assert len(history.history["value_loss"]) == 2 and history.history["val_loss"][1] > 0
    assert history.history["value_loss"][1] < history.history["value_loss"][0]  # It trains.
    assert [w.dtype for w in model.get_weights()] == ["float32"] * len(model.get_weights())
    evaluated = model.evaluate(run.distribute(train, global_batch_size=16), return_dict=True, verbose=0)  # One pass.
    assert np.isfinite(evaluated["loss"]) and "nonfinite_replicas" not in evaluated, evaluated
    predicted = model.predict({k: v[:5] for k, v in x.items()}, verbose=0)
    assert predicted["value"].shape == (5, 1) and predicted["kind"].shape == (5, my_models.KINDS)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "run", tmp_path / "run" / "backup",
                                                         tmp_path / "run" / "backup" / "chief-0",
                                                         tmp_path / "run" / "checkpoints")}
    assert set(modes.values()) == {0o700}, {k: oct(v) for k, v in modes.items()}  # Before: 0755 but the last.
    path = run.save(model)
    run.end()
    assert finished_backups(tmp_path / "run") == {"chief-0": [(32, True)]}  # Its last, for a rerun.
    assert (tmp_path / "run" / "summary.json").exists()
    code = ("import sys, keras, numpy as np; m = keras.models.load_model(sys.argv[1]); "
            "assert not [n for n in sys.modules if n.startswith('distrib_tf')]; "
            "print(m.predict({'features': np.zeros((1, 6)), 'meta': np.zeros((1, 3))}, verbose=0)['value'].shape)")
    loaded = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert loaded.returncode == 0 and "(1, 1)" in loaded.stdout, loaded.stderr[-3000:]


def test_any_random_access_source_an_image_folder_and_the_tf_data_hatch(tmp_path):
    rows = [(np.full((3,), i, np.float32), np.float32(i) / 10) for i in range(40)]
    source = distrib_tf.data.from_source(rows)
    x, y = source.make_reader()(tf.constant([3, 1], tf.int64))
    np.testing.assert_array_equal(x.numpy()[:, 0], [3, 1])
    np.testing.assert_allclose(y.numpy(), [0.3, 0.1])  # A float target stays float.
    for label, color in enumerate([(255, 0, 0), (0, 0, 255)]):
        folder = tmp_path / "images" / f"class{label}"
        folder.mkdir(parents=True)
        for i in range(3):
            image = np.zeros((10, 12, 3), np.uint8) + np.array(color, np.uint8)
            (folder / f"{i}.png").write_bytes(tf.io.encode_png(image).numpy())
    images = distrib_tf.data.load(f"images:{tmp_path / 'images'}")
    x, y = images.make_reader()(tf.constant([0, 5], tf.int64))
    assert x.shape == (2, 28, 28, 3) and list(y.numpy()) == [0, 1] and images.info.num_classes == 2
    assert x.numpy()[0, 0, 0, 0] == pytest.approx(1.0) and x.numpy()[1, 0, 0, 2] == pytest.approx(1.0)
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    with run.strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    hatch = distrib_tf.data.from_dataset_fn(
        lambda context: tf.data.Dataset.from_tensor_slices((np.ones((8, 3)), np.ones((8,)))).batch(4).repeat(),
        steps_per_epoch=2)
    assert run.fit(model, hatch, epochs=1, global_batch_size=4, verbose=0).epoch == [0]


@pytest.mark.parametrize("arguments, error", [
    ({"on_nan": "skip"}, "Invalid value for argument `on_nan`. Received: on_nan='skip'. Expected one of stop, "
                         "rollback."),
    ({"sync": "every:0"}, "Invalid value for argument `sync`. Received: sync='every:0'."),
    ({"backup_every_steps": 0}, "Invalid value for argument `backup_every_steps`. Received: backup_every_steps=0."),
])
def test_bad_run_arguments_are_one_line(tmp_path, arguments, error):
    with pytest.raises(InvalidRun) as raised:
        distrib_tf.Run(tmp_path, exit_on_error=False, **arguments)
    assert error in str(raised.value) and "\n" not in str(raised.value)


UNEVEN = """
import json, sys, keras, numpy as np, distrib_tf
from distrib_tf.keras import uneven
replicas, batch, weigh, reduction = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "weigh", sys.argv[4]
run = distrib_tf.Run(sys.argv[5], strategy="mirrored", cpu_replicas=replicas) if replicas else None
if run and not weigh:
    uneven.needed = lambda *args, **kwargs: False  # Keras's own arithmetic.
keras.config.set_floatx("float64")
x, y = np.random.RandomState(0).rand(11, 3), np.arange(11) % 2
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction),
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
print(json.dumps({"iterations": int(model.optimizer.iterations.numpy()), "history": history.history,
                  "weights": np.concatenate([w.ravel() for w in model.get_weights()]).tolist()}))
"""


@pytest.mark.parametrize("batch, reduction", [(5, "sum_over_batch_size"), (20, "sum_over_batch_size"), (5, "sum")])
def test_uneven_steps_train_every_row_as_one_process(tmp_path, batch, reduction):
    """Keras's `fit` trains every row: 11 rows in batches of 5 are steps of 5, 5 and 1, which
    split unevenly over 2 replicas (the last leaves one replica none, and the run says so in
    one line), a batch of 20 is one step of 11. The run weighs each row of a mean loss as one
    process does (`distrib_tf.keras.uneven`): the same iterations, History and weights as
    plain Keras in one process, to float64 rounding (a sum of 11 terms: the bound 1e-12 leaves
    3 orders to spare); Keras's own arithmetic (the same run without it) misses by 1e-4 or
    more, so the test can fail. A summed loss needs no weighing (Keras scales it by nothing)
    and gets none. Plain Keras itself under MirroredStrategy fails on the batch of 20 (an
    `AddN` of [6,3] and [5,3])."""
    def fit(*args):
        result = subprocess.run([sys.executable, "-c", UNEVEN, *map(str, args), reduction,
                                 str(tmp_path / f"run{args}")],
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT})
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1]), result.stdout + result.stderr

    (plain, _), (run, text) = fit(0, batch, "weigh"), fit(2, batch, "weigh")
    assert run["iterations"] == plain["iterations"] == 2 * -(-11 // batch)
    assert run["history"].keys() == plain["history"].keys()
    for key, values in plain["history"].items():  # (Keras logs a summed loss as a mean of the replicas' sums.)
        if not (key == "loss" and reduction == "sum"):
            np.testing.assert_allclose(run["history"][key], values, rtol=0, atol=1e-12)
    np.testing.assert_allclose(run["weights"], plain["weights"], rtol=0, atol=1e-12)
    assert ("a step of 1 row(s) for 2 replicas leaves some none" in text) == (batch == 5), text[-3000:]
    if reduction != "sum":
        keras_arithmetic, _ = fit(2, batch, "")
        assert np.abs(np.subtract(keras_arithmetic["weights"], plain["weights"])).max() > 1e-4


def test_a_halved_schedule_keeps_its_shape_and_serializes():
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=100)
    halved = schedules.Scaled.halving(schedules.Scaled.halving(schedule))
    assert float(halved(50)) == pytest.approx(float(schedule(50)) / 4)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(halved))
    assert float(again(50)) == pytest.approx(float(halved(50)))
    optimizer = keras.optimizers.AdamW(schedule)
    assert isinstance(schedules.schedule_of(optimizer), keras.optimizers.schedules.CosineDecay)
    assert schedules.schedule_of(keras.optimizers.Adam(1e-3)) is None


@pytest.mark.parametrize("fresh_start", [False, True])
def test_backups_of_the_run_are_resumed_unless_a_fresh_start_is_asked_for(tmp_path, capsys, fresh_start):
    """Never silently start over (issue 32): beside a backup of step 6 of this run, `fit`
    resumes there; `fresh_start=True` starts at 0 and says it deletes the backup."""
    x, y = np.arange(64, dtype="float32").reshape(32, 2) / 64, np.ones(32, "float32")

    def model_of(run):
        with run.strategy.scope():
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        return model

    first = distrib_tf.Run(tmp_path / "run", run_id="mine", exit_on_error=False)
    model = model_of(first)
    keep = worker_backup.WorkerBackup(first.backup_dir, run="mine", task="chief:0", steps_per_epoch=4)
    keep.set_model(model)
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(6)
    keep.step = 6
    keep.save()
    keep.flush()  # Written in the background: on the disk before the run looks (a loaded machine is slow).
    first.end()  # One Run at a time in a process.
    run = distrib_tf.Run(tmp_path / "run", run_id="mine", fresh_start=fresh_start, exit_on_error=False)
    run.fit(model_of(run), distrib_tf.data.from_arrays(x, y), epochs=2, global_batch_size=8, verbose=0)
    said = capsys.readouterr().out
    if fresh_start:
        assert "chief:0 starts at step 0 (fresh_start): deleted the backups of steps [6] of this run in" in said, said
        assert run.summary["resumed_at_step"] == 0
    else:
        assert "chief:0 resumes at step 6 (epoch 2, step 2 of it)" in said, said
        assert run.summary["resumed_at_step"] == 6


def test_a_second_fit_writes_checkpoints_of_its_own_names(tmp_path):
    """Issue 53: the second `fit` call of a run wrote `epoch001.weights.h5` over the first's.
    Now the first's stay `epochNNN`, the second's are `fit2-epochNNN`, each its own weights."""
    x, y = np.arange(64, dtype="float32").reshape(32, 2) / 64, np.ones(32, "float32")
    run = distrib_tf.Run(tmp_path / "run", seed=0, exit_on_error=False)

    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    with run.strategy.scope():
        model = build()
    stages = []
    for _ in range(2):
        run.fit(model, distrib_tf.data.from_arrays(x, y), epochs=1, global_batch_size=8, verbose=0)
        stages.append(model.get_weights())
    run.end()
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.weights.h5")) == ["epoch001.weights.h5", "fit2-epoch001.weights.h5"]
    for name, expected in zip(["epoch001.weights.h5", "fit2-epoch001.weights.h5"], stages):
        written = build()
        written.load_weights(folder / name)
        assert all(np.array_equal(a, b) for a, b in zip(written.get_weights(), expected)), name
    assert not all(np.array_equal(a, b) for a, b in zip(*stages))  # The second fit trained on.


def test_steps_per_execution_on_a_dataset_runs_keras_steps_and_batches(tmp_path):
    """Issue 60 item 4: `compile(steps_per_execution=4)`, a `tf.data.Dataset` of 10 batches,
    2 epochs. Plain Keras ends each epoch's last execution when the data ends: 20 steps. The
    run fed one endless iterator with `steps_per_epoch=10`, whose executions ran past the
    epochs' ends: 24 steps, other batches, other weights. Now each epoch is one pass of the
    dataset, as in Keras (reshuffled by its own seed each epoch): the same iterations, History
    and weights bit for bit."""
    x = np.arange(120, dtype="float32").reshape(40, 3) / 120
    y = x.sum(1, keepdims=True)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
        return model

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(40, seed=3).batch(4)

    plain = build()
    expected = plain.fit(dataset(), epochs=2, shuffle=False, verbose=0)  # (The dataset shuffles itself.)
    run = distrib_tf.Run(tmp_path / "run", seed=0, exit_on_error=False)
    with run.strategy.scope():
        model = build()
    history = run.fit(model, dataset(), epochs=2, verbose=0)
    run.end()
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 20
    assert history.history == expected.history and history.epoch == expected.epoch == [0, 1]
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


LOCAL_SGD_AFTER = """
import json, sys, keras, numpy as np, distrib_tf
run = distrib_tf.Run(sys.argv[1], sync="every:2", strategy="mirrored", cpu_replicas=2, exit_on_error=False)
rng = np.random.default_rng(0)
x = rng.normal(size=(32, 3)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5]], "float32")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
ours = sorted(name for name in vars(model.optimizer) if "distrib_tf" in name)
run.end()
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # Plain Keras's fit, on the run's model.
strategy = model.distribute_strategy
spread = max(float(np.abs(parts[0].numpy() - parts[1].numpy()).max())
             for parts in (strategy.experimental_local_results(w.value) for w in model.weights))
print(json.dumps({"ours": ours, "spread": spread}))
"""


def test_after_a_periodic_sync_fit_the_optimizer_all_reduces_again(tmp_path):
    """Issue 60 item 11: `sync="every:2"` made the optimizer skip its gradient all-reduce (each
    replica its own step) and left it so after `fit`: a later plain Keras `fit` of the model
    trained the two replicas apart. Now nothing of the run stays on the optimizer, and the
    plain fit keeps the replicas' weights equal, bit for bit."""
    result = subprocess.run([sys.executable, "-c", LOCAL_SGD_AFTER, str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    after = json.loads(result.stdout.splitlines()[-1])
    assert after == {"ours": [], "spread": 0.0}, after


class _ReadsInfOnce:
    """Rows `x, y` as a random-access source; row `bad` reads Inf the first time (a bad read)."""

    def __init__(self, x, y, bad):
        self.x, self.y, self.bad, self.read_bad = x, y, bad, False

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if i == self.bad and not self.read_bad:
            self.read_bad = True
            return np.full_like(self.x[i], np.inf), self.y[i]
        return self.x[i], self.y[i]


@keras.saving.register_keras_serializable(package="tests")
class _MySchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A user's own schedule: distrib_tf cannot halve it in Keras's terms."""

    def __call__(self, step):
        return 0.1 / (1.0 + keras.ops.cast(step, "float32"))

    def get_config(self):
        return {}


def test_after_a_rollback_the_users_model_save_loads_in_plain_keras(tmp_path, capsys):
    """Issue 60 item 11: a rollback under a schedule left distrib_tf's `Scaled` on the user's
    optimizer, so their own `model.save` needed distrib_tf to load. Now a Keras schedule is
    halved in Keras's terms (CosineDecay from 0.05 instead of 0.1: what the rollback trained
    on), which plain Keras loads in a fresh process; the user's own schedule comes back as
    made, and one line says the halving is not kept."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5], "float32"))[:, None]
    with distrib_tf.Run(tmp_path / "run", on_nan="rollback", backup_every_steps=2, exit_on_error=False) as run:
        models = []
        for schedule in [keras.optimizers.schedules.CosineDecay(0.1, decay_steps=8), _MySchedule()]:
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
            model.fit(distrib_tf.data.from_source(_ReadsInfOnce(x, y, bad=16)), global_batch_size=8, epochs=2,
                      shuffle=False, verbose=0)  # Row 16: step 3; rolled back to step 2.
            assert [r["at_step"] for r in run.summary["rollbacks"]] == [3]
            models.append(model)
    path = str(tmp_path / "mine.keras")
    models[0].save(path)  # The user's own save.
    code = ("import sys, keras; m = keras.saving.load_model(sys.argv[1]); "
            "assert not [n for n in sys.modules if n.startswith('distrib_tf')]; "
            "c = m.optimizer.get_config()['learning_rate']; "
            "print(c['class_name'], c['config']['initial_learning_rate'])")
    loaded = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert loaded.returncode == 0 and loaded.stdout.split() == ["CosineDecay", "0.05"], loaded.stderr[-3000:]
    said = capsys.readouterr().out
    assert said.count("Rolled back to step 2") == 2, said
    assert "chief:0: the rollbacks trained on 0.5 of the learning rate of _MySchedule, not one of Keras's" in said
    assert type(models[1].optimizer._learning_rate) is _MySchedule  # pylint: disable=protected-access
