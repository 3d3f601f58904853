"""Keras's own `model.fit` under a live `distrib_tf.Run`: Keras's arguments and History,
several stages each resumed at its step, stateful callbacks that carry on after a restart
(tests/workers/keras_stages.py, one process, two replicas, a Dropout)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from workers import faults

import cluster_runner
import distrib_tf
from cluster_runner import QUIET_TF
from cluster_runner import finished_backups
from cluster_runner import run_script

ROOT = os.path.dirname(os.path.dirname(__file__))
SCRIPT = os.path.join(ROOT, "tests", "workers", "keras_stages.py")
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}


@pytest.fixture(autouse=True)
def _sigterm_as_it_was():
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def _plain_and_run(tmp_path, fit):
    """The same Keras lines, `fit(model)`, without distrib_tf and under a live Run."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype("float32")
    y = x[:, :3].argmax(axis=1)  # Learnable: the loss falls.

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(3)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    plain = build()
    results = [fit(plain, x, y), plain.evaluate(x, y, return_dict=True, verbose=0)]
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        model = build()
        assert model.distribute_strategy is run.strategy  # Built under it without a scope of its own.
        results += [fit(model, x, y), model.evaluate(x, y, return_dict=True, verbose=0)]
    finally:
        run.end()
    return results


@pytest.mark.parametrize("fit", [
    lambda m, x, y: m.fit(x, y, batch_size=20, epochs=2, validation_split=0.2, verbose=0),
    lambda m, x, y: m.fit(x, y, batch_size=20, epochs=2, validation_data=(x[:40], y[:40]),
                          sample_weight=np.linspace(0.5, 1.5, len(y)), verbose=0),
    lambda m, x, y: m.fit(x, y, batch_size=20, epochs=2, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, verbose=0),
], ids=["validation_split", "validation_data_and_sample_weight", "class_weight"])
def test_model_fit_takes_keras_arguments_and_gives_plain_keras_history(tmp_path, fit):
    plain_history, plain_evaluate, history, evaluate = _plain_and_run(tmp_path, fit)
    assert sorted(history.history) == sorted(plain_history.history), history.history  # Nothing of ours.
    assert history.epoch == plain_history.epoch == [0, 1]
    assert sorted(evaluate) == sorted(plain_evaluate) == ["accuracy", "loss"]
    assert history.history["loss"][1] < history.history["loss"][0]  # It trains.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "examples_per_second" in summary["epochs"][0] and "nonfinite_replicas" in summary["epochs"][0]


def test_epoch_metrics_of_a_custom_step_and_an_evaluate_inside_fit_are_plain_keras_ones(tmp_path):
    """Under a run of 2 replicas (tests/workers/epoch_metrics.py): keras.io's custom
    `train_step` with its own metrics ends each epoch on their results over every replica,
    as plain Keras does (the NaN check's key in `get_metrics_result` made Keras take the last
    step's logs, per-replica AUC and Precision); and an `evaluate` inside a callback during
    `fit` returns plain Keras's values, not one more (issue 60 item 10)."""
    code, text, result = run_script(os.path.join(ROOT, "tests", "workers", "epoch_metrics.py"), tmp_path / "run",
                                    env=ENV)
    assert code == 0, text[-3000:]
    run, plain = result["run"], result["plain"]
    for model in ("own", "compiled"):
        np.testing.assert_allclose(run[model]["weights"], plain[model]["weights"], rtol=1e-5, atol=1e-7)
        assert run[model]["history"].keys() == plain[model]["history"].keys()
    for key in ("auc", "precision"):  # (Its loss is Keras's scaled one under a strategy: its own tracker's.)
        np.testing.assert_allclose(run["own"]["history"][key], plain["own"]["history"][key], rtol=1e-6, err_msg=key)
    for key, values in plain["compiled"]["history"].items():
        np.testing.assert_allclose(run["compiled"]["history"][key], values, rtol=1e-6, err_msg=key)
    evaluated, plain_evaluated = run["compiled"]["evaluate_in_fit"], plain["compiled"]["evaluate_in_fit"]
    assert [len(r) for r in evaluated] == [len(r) for r in plain_evaluated] == [3, 3], evaluated  # loss, accuracy, auc.
    np.testing.assert_allclose(evaluated, plain_evaluated, rtol=1e-5)


def test_a_dataset_without_a_length_needs_steps_and_a_bad_argument_is_one_line(tmp_path):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        endless = tf.data.Dataset.from_tensor_slices((np.ones((8, 2)), np.ones(8))).batch(4).repeat()
        with pytest.raises(distrib_tf.run.InvalidRun, match=r"Invalid value for argument `x`.*`steps_per_epoch`"):
            model.fit(endless, epochs=1)
        assert model.fit(endless, epochs=1, steps_per_epoch=2, verbose=0).epoch == [0]
        with pytest.raises(distrib_tf.run.InvalidRun, match=r"Invalid value for argument `validation_split`"):
            model.fit(np.ones((8, 2)), np.ones(8), validation_split=1.5)
        with pytest.raises(distrib_tf.run.InvalidRun, match=r"`steps_per_epoch`. Received: None with a Python gen"):
            model.fit((batch for batch in [(np.ones((4, 2)), np.ones(4))]), epochs=1)
    finally:
        run.end()


@pytest.mark.parametrize("above, arguments, below, said", [
    ("", "on_nan='skip'", "", "Invalid value for argument `on_nan`. Received: on_nan='skip'. Expected one of stop, "
     "rollback."),
    # keras.io's image scripts load their data first (issue 50): the strategy is made too late.
    ("import tensorflow as tf\ndata = tf.data.Dataset.range(8).batch(2)\n", "cpu_replicas=2", "",
     "distrib_tf.Run(...) came after the script's first TensorFlow operation"),
    # A script that keeps its own strategy beside a run: TensorFlow refuses to mix them.
    ("import tensorflow as tf\n", "", "with tf.distribute.MirroredStrategy().scope():\n    pass\n",
     "Invalid strategy scope: the script entered the scope of a strategy of its own while a run is live. "
     "Received: MirroredStrategy.scope()."),
], ids=["bad_argument", "after_a_tf_data_pipeline", "a_strategy_of_its_own"])
def test_a_bad_run_argument_exits_2_with_one_line(tmp_path, above, arguments, below, said):
    script = f"{above}import distrib_tf\nrun = distrib_tf.Run({str(tmp_path / 'run')!r}, {arguments})\n{below}"
    result = cluster_runner.run([sys.executable, "-c", script], timeout=120, env=ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("python: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"python: error: {said}"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_sigterm_outside_fit_keeps_its_default_meaning(tmp_path):
    """A script loading its data (before any fit) is ended by SIGTERM, as without distrib_tf:
    not caught and ignored until a SIGKILL."""
    script = (f"import time, distrib_tf\nrun = distrib_tf.Run({str(tmp_path / 'run')!r})\n"
              "print('loading', flush=True)\ntime.sleep(120)\n")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=ENV) as proc:
        try:
            for line in proc.stdout:
                if line.strip() == "loading":
                    break
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _script(model_dir, *args):
    return run_script(SCRIPT, model_dir, *args, env=ENV)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    code, text, result = _script(model_dir)
    assert code == 0, text[-3000:]
    pytest.uninterrupted_dir = model_dir  # For the rerun test.
    return result


def test_a_finished_script_run_again_returns_at_once_and_a_changed_one_starts_over(uninterrupted):
    """Issue 41: a finished script run again trained again from scratch (with `with`) or
    returned an empty History (without). Now each fit returns its History and final state
    at once; a script whose training changed (here: arrays instead of the dataset) starts over."""
    code, text, again = _script(pytest.uninterrupted_dir)
    assert code == 0, text[-3000:]
    assert "chief:0: fit 1 finished at step 16 before" in text and "chief:0: fit 2 finished at step 18 before" in text
    assert again["epochs_trained"] == [] and again["train_begins"] == 0  # Nothing trained.
    assert again["weights"] == uninterrupted["weights"] and again["histories"] == uninterrupted["histories"]
    code, text, changed = _script(pytest.uninterrupted_dir, "--early_stopping")
    assert code == 0, text[-3000:]
    assert "chief:0 starts at step 0: its backup of step 16 in" in text and "another script" in text, text[-3000:]
    assert changed["epochs_trained"] == [1, 2, 3]


@pytest.mark.parametrize("stage, step", [  # Inside the 2nd epoch of each stage; make soak runs the first.
    pytest.param(0, 11, marks=pytest.mark.slow), (1, 8)])
def test_a_stage_preempted_resumes_at_its_step_and_the_script_ends_bit_identical(tmp_path, uninterrupted,
                                                                                  stage, step):
    """Fit the head on a tf.data.Dataset (2 replicas), unfreeze, recompile, fine-tune on arrays:
    a SIGTERM in either stage exits 75; the restart returns the finished stage at once and
    resumes the interrupted one at its step; the weights are the uninterrupted run's, bit for bit."""
    code, text, _ = _script(tmp_path / "run", f"--sigterm_at_step={step}", f"--sigterm_stage={stage}")
    assert code == 75, text[-3000:]
    assert f"chief:0 preempted: backed up step {step}" in text, text[-3000:]
    code, text, resumed = _script(tmp_path / "run")
    assert code == 0, text[-3000:]
    assert f"chief:0 resumes at step {step} (epoch 2, step {step - (8 if stage == 0 else 6)} of it)" in text, (
        text[-3000:])
    if stage == 0:
        assert "replays a tf.data.Dataset to step 11" in text, text[-3000:]
    else:  # The head's stage came back finished, with its History, without training.
        assert resumed["histories"][0] == uninterrupted["histories"][0]
    assert resumed["weights"] == uninterrupted["weights"], (resumed, uninterrupted)
    for mine, theirs in zip(resumed["histories"], uninterrupted["histories"]):
        assert sorted(mine) == sorted(theirs) and len(mine["loss"]) == len(theirs["loss"])
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)  # The resumed epoch over all its steps.
    # The user's callback: one training though two Keras fits ran; none in a stage that came back finished.
    assert resumed["train_begins"] == (1 if stage == 0 else 0)
    assert finished_backups(tmp_path / "run") == {"chief-0": [(16, True)], "fit2/chief-0": [(18, True)]}


def test_early_stopping_preempted_between_its_epochs_stops_where_the_uninterrupted_run_does(tmp_path):
    """EarlyStopping(patience=2, restore_best_weights=True) set wait=1 at the end of epoch 2; a
    SIGTERM inside epoch 3: the restart goes on from its state, its best weights (epoch 1's)
    included, stops after epoch 3 and restores them, as the run never interrupted."""
    code, text, plain = _script(tmp_path / "plain", "--early_stopping")
    assert code == 0 and plain["epochs_trained"] == [1, 2, 3], text[-3000:]
    code, text, _ = _script(tmp_path / "run", "--early_stopping", "--sigterm_at_step=19")  # Epoch 3, step 3.
    assert code == 75, text[-3000:]
    code, text, resumed = _script(tmp_path / "run", "--early_stopping")
    assert code == 0, text[-3000:]
    assert resumed["epochs_trained"] == [3], resumed  # Not 3 and 4: its wait carried on.
    assert len(resumed["histories"][0]["loss"]) == 3 and resumed["weights"] == plain["weights"]


@pytest.mark.parametrize("policy", ["mixed_float16", pytest.param("mixed_bfloat16", marks=pytest.mark.slow)])
def test_mixed_precision_trains_and_a_loss_scale_overflow_is_no_nan_stop(tmp_path, policy):
    """Under `mixed_float16` a loss scale of 2**40 overflows the first steps' gradients: Keras's
    LossScaleOptimizer skips them and lowers the scale, which the run takes for no NaN stop."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype("float32"), rng.normal(size=(128, 1)).astype("float32")
    keras.mixed_precision.set_global_policy(policy)
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        optimizer = keras.optimizers.SGD(0.01)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 40)
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    finally:
        run.end()
        keras.mixed_precision.set_global_policy("float32")
    assert model.layers[0].compute_dtype == policy.split("_")[1]
    assert history.epoch == [0, 1] and np.isfinite(history.history["loss"]).all()
    if policy == "mixed_float16":
        assert float(optimizer.dynamic_scale.numpy()) < 2.0 ** 40  # Overflowing steps were skipped.
        assert int(optimizer.iterations.numpy()) == 16  # Counted all the same (every layout alike).


class _Shuffled(keras.utils.PyDataset):
    """Keras's batches by index, reshuffled by every `on_epoch_end` (seeded by the epoch)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.epoch, self.order, self.read = x, y, 0, np.arange(4), []

    def __len__(self):
        return 4

    def __getitem__(self, index):
        self.read.append(index)
        rows = self.order[index] * 8 + np.arange(8)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epoch += 1
        self.order = np.random.default_rng(self.epoch).permutation(4)


def test_a_py_dataset_resumes_at_its_step_reading_no_batch_before_it(tmp_path):
    x = np.arange(64, dtype="float32").reshape(32, 2)
    y = x.sum(axis=1, keepdims=True)
    source = _Shuffled(x, y)
    batches = distrib_tf.data.from_py_dataset(source)
    source.read.clear()
    resumed = [b for b, _ in batches.batches(6, False).as_numpy_iterator()]  # Step 6: epoch 2, batch 2.
    expected = _Shuffled(x, y)
    expected.on_epoch_end()  # What Keras would have called after epoch 1.
    assert [b.tolist() for b in resumed] == [expected[2][0].tolist(), expected[3][0].tolist()]
    assert source.read == [2, 3]  # Not the six batches before it.
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(_Shuffled(x / 64, y / 64), epochs=2, verbose=0)
    finally:
        run.end()
    assert history.epoch == [0, 1] and sorted(history.history) == ["loss"]
    assert int(model.optimizer.iterations.numpy()) == 8


def _vector_metric(m):
    m.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True),
              metrics=[keras.metrics.F1Score()])
    return m


KERAS_MEANINGS = {  # Each: what a Keras user writes, on a fresh compiled model; `y` class ids (one-hot for F1Score).
    "partial_class_weight_and_validation_split": lambda m, x, y: m.fit(
        x, y, batch_size=20, epochs=2, class_weight={1: 3.0}, validation_split=0.2, shuffle=False, verbose=0),
    "validation_data_as_a_list": lambda m, x, y: m.fit(
        x, y, batch_size=20, epochs=2, validation_data=[x[:40], y[:40]], shuffle=False, verbose=0),
    "reduce_lr_on_plateau_in_history": lambda m, x, y: m.fit(
        x, y, batch_size=20, epochs=3, validation_split=0.2, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.ReduceLROnPlateau(patience=0, min_delta=1.0)]),
    "a_second_fit_without_recompiling": lambda m, x, y: (
        m.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0),
        m.fit(x, y, batch_size=50, epochs=3, shuffle=False, verbose=0))[1],
    "initial_epoch_after_a_fit": lambda m, x, y: (
        m.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0),
        m.fit(x, y, batch_size=50, initial_epoch=2, epochs=4, shuffle=False, verbose=0))[1],
    "steps_per_execution": lambda m, x, y: (
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=4),
        m.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0))[1],
    "a_vector_metric": lambda m, x, y: _vector_metric(m).fit(
        x, keras.utils.to_categorical(y, 2), batch_size=20, epochs=2, shuffle=False, verbose=0),
}


def test_keras_meanings_under_a_run_end_as_in_plain_keras(tmp_path, capsys):
    """Issue 50: each of Keras's meanings above, in plain Keras and through a live Run in one
    process (no shuffle, same seed): the same final weights bit for bit, the same optimizer
    iterations and the same History (its keys, `learning_rate` included, and values)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype("float32")
    y = x[:, :2].argmax(axis=1)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def outcome(fit):
        model = build()
        history = fit(model, x, y)
        return model.get_weights(), int(model.optimizer.iterations.numpy()), history.history

    plain = {name: outcome(fit) for name, fit in KERAS_MEANINGS.items()}
    run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
    try:
        ours = {name: outcome(fit) for name, fit in KERAS_MEANINGS.items()}
    finally:
        run.end()
    assert len(os.listdir(tmp_path / "run" / "backup")) > 1  # Through the run: its fits' backups.
    for name in KERAS_MEANINGS:
        (plain_weights, plain_iterations, plain_history), (weights, iterations, history) = plain[name], ours[name]
        assert iterations == plain_iterations, name
        assert all(np.array_equal(a, b) for a, b in zip(weights, plain_weights)), name
        assert sorted(history) == sorted(plain_history), (name, history)
        for key, values in plain_history.items():
            np.testing.assert_array_equal(np.asarray(history[key]), np.asarray(values), err_msg=f"{name}: {key}")
    assert "learning_rate" in ours["reduce_lr_on_plateau_in_history"][2]
    assert ours["a_vector_metric"][2]["f1_score"][0].shape == (2,)


def test_the_run_survives_what_keras_users_do_to_sessions(tmp_path):
    """Issue 50: after `keras.backend.clear_session()` the script's next model is the run's
    (its fit backed up); a model built before `Run(...)` and a second Run are one-line
    refusals; Keras's `fit` and the default strategy are the script's again once the run
    ends, an error leaving its `with` block included."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    x, y = np.ones((16, 2), "float32"), np.ones(16, "float32")

    def build(name=None):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name=name)
        model.compile(optimizer="sgd", loss="mse")
        return model

    before = build("built_before")
    with pytest.raises(RuntimeError, match="left the block"):
        with distrib_tf.Run(tmp_path / "run", exit_on_error=False) as run:
            with pytest.raises(distrib_tf.run.InvalidRun, match=r"'built_before' was built under another strategy"):
                before.fit(x, y, batch_size=8, epochs=1, verbose=0)
            with pytest.raises(distrib_tf.run.InvalidRun, match=r"while Run\(.*\) is live in this process"):
                distrib_tf.Run(tmp_path / "other", exit_on_error=False)
            keras.backend.clear_session()
            model = build()
            assert model.distribute_strategy is run.strategy
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            assert os.path.isdir(tmp_path / "run" / "backup" / "chief-0")
            raise RuntimeError("left the block")
    assert "fit" not in vars(keras.Model) and tf.distribute.get_strategy() is not run.strategy
    assert build().fit(x, y, epochs=1, verbose=0).epoch == [0]  # Plain Keras: nothing of the run's.
    assert not os.path.isdir(tmp_path / "run" / "backup" / "fit2")


@pytest.fixture(scope="module")
def trained_more(tmp_path_factory):
    code, text, result = _script(tmp_path_factory.mktemp("trained_more") / "run", "--train_more")
    assert code == 0, text[-3000:]
    return result


# Executions end at 16 + 3, 6, 8, 11, ...: inside the second epoch; the last (make soak).
@pytest.mark.parametrize("iteration", [27, pytest.param(38, marks=pytest.mark.slow)])
def test_a_second_fit_without_recompiling_preempted_resumes_at_its_own_step(tmp_path, trained_more, iteration):
    """Issue 50: `fit(epochs=2)`, then `fit(epochs=3)` on the same compiled model with 3 steps
    an execution (one replica, a Dropout), SIGTERM in the second fit at an execution's end: it
    backs up the second fit's own step (iteration - 16), the restart resumes there and ends on
    the uninterrupted run's weights, iterations (16 + 24) and Histories."""
    uninterrupted = trained_more
    assert uninterrupted["iterations"] == 40 and len(uninterrupted["histories"][1]["loss"]) == 3
    step = iteration - 16
    code, text, _ = _script(tmp_path / "run", "--train_more", f"--sigterm_at_step={iteration}", "--sigterm_stage=1")
    assert code == 75, text[-3000:]
    assert f"chief:0 preempted: backed up step {step}" in text, text[-3000:]
    code, text, resumed = _script(tmp_path / "run", "--train_more")
    assert code == 0, text[-3000:]
    assert f"chief:0 resumes at step {step} (epoch {step // 8 + 1}, step {step % 8} of it)" in text, text[-3000:]
    assert resumed["iterations"] == 40 and resumed["weights"] == uninterrupted["weights"]
    assert resumed["histories"][0] == uninterrupted["histories"][0]
    assert resumed["histories"][1]["loss"] == pytest.approx(uninterrupted["histories"][1]["loss"], rel=1e-6)


def _fit_end_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype("float32")
    return x, x[:, :2].argmax(axis=1)


def _fit_end_model(**compile_args):
    keras.backend.clear_session()  # The same variable names each time: the same run to resume.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_args)
    return model


def test_a_finished_fit_run_again_returns_the_state_keras_left_after_restoring_the_best_weights(tmp_path):
    """Issue 60 item 1: EarlyStopping(restore_best_weights=True) stops after epoch 3 and
    restores epoch 1's weights in `on_train_end`. The same lines through a Run, twice in one
    model_dir (the second returns the finished fit from its backup), end on plain Keras's
    weights both times, bit for bit (before: the backup was taken before the restore, and the
    second run returned epoch 3's weights)."""
    x, y = _fit_end_data()

    def fit(model):
        stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=1e9, restore_best_weights=True)
        history = model.fit(x, y, batch_size=20, epochs=6, shuffle=False, callbacks=[stop], verbose=0)
        assert len(history.history["loss"]) == 3
        return model.get_weights()

    plain = fit(_fit_end_model(optimizer="adam"))
    ours = []
    for _ in range(2):
        run = distrib_tf.Run(tmp_path / "run", exit_on_error=False)
        try:
            ours.append(fit(_fit_end_model(optimizer="adam")))
        finally:
            run.end()
    for weights in ours:
        assert all(np.array_equal(a, b) for a, b in zip(weights, plain))


@pytest.mark.parametrize("case", ["steps_per_execution", "resumed"])
def test_use_ema_swaps_once_at_the_stage_end_as_plain_keras(tmp_path, case):
    """Issue 60 item 1: Keras's `fit` ends by swapping the optimizer's EMA into the weights
    (`use_ema=True`). A stage of several Keras fits (one an epoch under `steps_per_execution`;
    a partial epoch resumed, then the rest) swaps once, at its end: plain Keras's weights,
    bit for bit (before: each inner fit swapped, and training went on from the EMA)."""
    x, y = _fit_end_data()
    execution = 2 if case == "steps_per_execution" else 1

    def fit(model, *callbacks):
        model.fit(x, y, batch_size=20, epochs=3, shuffle=False, callbacks=list(callbacks), verbose=0)
        return model.get_weights()

    def model():
        return _fit_end_model(optimizer=keras.optimizers.Adam(use_ema=True, ema_overwrite_frequency=None),
                              steps_per_execution=execution)

    plain = fit(model())
    if case == "resumed":  # Crashed at step 17 of 30: resumed from the backup of step 15 (epoch 2, step 5 of it).
        with pytest.raises(RuntimeError, match="crashed"):
            with distrib_tf.Run(tmp_path / "run", backup_every_steps=5, exit_on_error=False):
                fit(model(), faults.Crash(17))
    with distrib_tf.Run(tmp_path / "run", backup_every_steps=5, exit_on_error=False) as run:
        ours = fit(model())
    assert run.summary["resumed_at_step"] == (15 if case == "resumed" else 0)
    assert all(np.array_equal(a, b) for a, b in zip(ours, plain))


GAN_SCRIPT = os.path.join(ROOT, "tests", "workers", "gan_resume.py")


def test_a_gan_with_optimizers_of_its_own_crashed_inside_an_epoch_resumes_bit_identical(tmp_path):
    """Issue 60 item 3: keras.io's DCGAN shape trains with two optimizers of its own and never
    moves `model.optimizer`, whose `iterations` was the run's step: every backup was "step 0"
    and a crash restarted from scratch, the optimizers' slots not backed up. The run counts
    the batches trained itself: crashed at step 7 (epoch 2), the backups hold steps 4 (epoch 1's
    end) and 5 (every 5), the restart resumes at 5 (their slots and iterations restored) and ends on the
    uninterrupted run's weights of both networks and variables of both optimizers, bit for bit."""
    texts = []
    for args in ([], ["--resume"]):
        proc = subprocess.run([sys.executable, GAN_SCRIPT, str(tmp_path), *args], env=ENV, capture_output=True,
                              text=True, timeout=300, check=False)
        texts.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, texts[-1][-3000:]
    first = json.loads((tmp_path / "first.json").read_text())
    uninterrupted, resumed = first["uninterrupted"], json.loads((tmp_path / "resumed.json").read_text())
    assert first["crash"] == "crashed" and first["backups"] == [4, 5], first["backups"]  # Were: [0].
    assert "chief:0 resumes at step 5 (epoch 2, step 1 of it)" in texts[1], texts[1][-3000:]
    assert not any("did not count this step" in text for text in texts), texts
    assert resumed["resumed_at_step"] == 5 and uninterrupted["resumed_at_step"] == 0
    assert uninterrupted["iterations"] == resumed["iterations"] == [12, 12]
    assert resumed["weights"] == uninterrupted["weights"]
    assert resumed["optimizers"] == uninterrupted["optimizers"]


def test_a_gan_whose_step_logs_losses_of_its_own_stops_at_the_step_its_weights_turn_nan(tmp_path):
    """A `train_step` of the model's own (keras.io's DCGAN) returns `d_loss` and `g_loss` and
    never updates the run's NaN metric: a NaN image trained on silently to the end, every
    weight NaN. The run checks the weights itself there: it stops at the step that took the
    NaN batch, on both replicas, naming the replicas whose weights hold it."""
    script = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "tests", "workers")!r})
import distrib_tf
run = distrib_tf.Run({str(tmp_path / "run")!r}, strategy="mirrored", cpu_replicas=2, exit_on_error=False)
import keras, numpy as np, tensorflow as tf
from keras_io_shapes import make_gan
images = np.random.RandomState(3).rand(32, 8, 8, 1)
images[17] = np.nan  # The third batch of 8: step 3.
with run:
    gan = make_gan(keras, tf)
    try:
        gan.fit(tf.data.Dataset.from_tensor_slices(images).batch(8), epochs=2, verbose=0)
    except distrib_tf.NonFiniteLoss as error:
        print("STOPPED", error.step, error)
"""
    proc = cluster_runner.run([sys.executable, "-c", script], timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = ("STOPPED 3 Non-finite loss or gradient at step 3 (epoch 1); NaN or Inf first seen in the weights "
            "of replica 0")
    assert said in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_gan_on_two_workers_one_of_them_without_its_backup_resumes_bit_identical(tmp_path):
    """The GAN of the test above on 2 workers, each on a disk of its own, crashed at step 7,
    worker 1's backups then lost (a host that lost its disk): worker 1 receives step 5's
    state from worker 0, the optimizers the model holds included. A worker holding the backup
    built them on its own while loading it (creating their variables: a collective under
    MultiWorkerMirroredStrategy) while the other built them after receiving the metadata, and
    the resume hung; now every worker builds them at one point, and both end on the
    uninterrupted run's weights and optimizer variables, bit for bit."""
    spec = cluster_runner.local_spec(2)
    for phase in ("uninterrupted", "crashed"):
        results = cluster_runner.run_cluster([GAN_SCRIPT, tmp_path, "--workers", phase], spec=spec,
                                             env={"PYTHONPATH": ROOT}, timeout=240)
        cluster_runner.check_ok(results)
    assert all(json.loads((tmp_path / f"crashed-{i}.json").read_text()) == {"crash": "crashed"} for i in (0, 1))
    host = tmp_path / "crashed" / "host-1"  # Worker 1's disk, which holds its backups only.
    assert [step for step, _ in finished_backups(host)["worker-1"]] == [4, 5]
    shutil.rmtree(host / "backup")
    results = cluster_runner.run_cluster([GAN_SCRIPT, tmp_path, "--workers", "resumed"], spec=spec,
                                         env={"PYTHONPATH": ROOT}, timeout=240)
    cluster_runner.check_ok(results)
    said = "worker:1 resumes at step 5 (epoch 2, step 1 of it) from a peer"
    assert said in results[1].output, results[1].output[-3000:]
    for index in (0, 1):
        uninterrupted = json.loads((tmp_path / f"uninterrupted-{index}.json").read_text())
        resumed = json.loads((tmp_path / f"resumed-{index}.json").read_text())
        assert resumed["resumed_at_step"] == 5 and uninterrupted["resumed_at_step"] == 0
        assert resumed["weights"] == uninterrupted["weights"]
        assert resumed["optimizers"] == uninterrupted["optimizers"]
