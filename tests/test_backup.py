"""Per-worker backups: torn writes, and the one resume point every worker agrees on."""

import hashlib
import json
import os

import keras
import numpy as np
import pytest

from distrib_tf.keras import backup


class KilledWhileWriting(Exception):
    pass


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _callback(directory, model, every_steps=None):
    callback = backup.WorkerBackup(str(directory), run="run-a", task="chief:0", steps_per_epoch=4,
                                   every_steps=every_steps)
    callback.set_model(model)
    return callback


def test_killed_while_writing_restores_the_last_good_one(tmp_path):
    model = _model()
    first = [w.copy() for w in model.get_weights()]
    callback = _callback(tmp_path, model)
    callback.step = 4
    callback.on_epoch_end(0)

    def half_write(filepath, overwrite=True):
        with open(filepath, "wb") as f:
            f.write(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)  # A torn file, as left by SIGKILL.
        raise KilledWhileWriting()

    model.save_weights = half_write
    model.set_weights([w + 1 for w in first])
    callback.step = 8
    with pytest.raises(KilledWhileWriting):
        callback.on_epoch_end(1)
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [4]
    restored = _model()
    assert backup.agree_on_resume(restored, str(tmp_path), run="run-a", task="chief:0") == 4
    for a, b in zip(restored.get_weights(), first):
        np.testing.assert_array_equal(a, b)


def test_keeps_the_last_two_and_saves_every_n_steps(tmp_path):
    model = _model()
    callback = _callback(tmp_path, model, every_steps=3)
    callback.on_train_begin()
    for batch in range(8):
        callback.on_train_batch_end(batch)
        if batch % 4 == 3:
            callback.on_epoch_end(batch // 4)
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [6, 8]
    meta = json.loads((tmp_path / "step-000000008.json").read_text())
    weights = tmp_path / "step-000000008.weights.h5"
    assert meta == {"run": "run-a", "step": 8, "epoch": 2, "task": "chief:0", "bytes": weights.stat().st_size,
                    "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), "seeds": [],
                    "history": [{"epoch": 1}, {"epoch": 2}], "callbacks": [], "stopped": False}  # No Dropout.
    backup.remove_backups(str(tmp_path))
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncated", "bit flipped"])
def test_weights_damaged_after_a_crash_fall_back_to_the_backup_before(tmp_path, damage):
    """The metadata of step 8 was committed, its weights did not survive (a crash before the
    page cache reached the disk, a bad sector): the backup is not listed, the resume takes 4."""
    model = _model()
    callback = _callback(tmp_path, model)
    callback.step = 4
    callback.on_epoch_end(0)
    first = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in first])
    callback.step = 8
    callback.on_epoch_end(1)
    weights = tmp_path / "step-000000008.weights.h5"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else
                        data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [4]
    restored = _model()
    assert backup.agree_on_resume(restored, str(tmp_path), run="run-a", task="chief:0") == 4
    for a, b in zip(restored.get_weights(), first):
        np.testing.assert_array_equal(a, b)


def test_a_worker_killed_writing_its_first_backup_starts_again_with_its_peers(tmp_path):
    """worker:0 holds the start and step 5; worker:1 was killed while writing step 5, so
    holds the start only: every worker starts again at 0 (it was a ResumeError, "worker:1
    holds no backup", seen in make test-engines when a pod was killed that early)."""
    rows = []
    for task, steps in (("worker:0", [0, 5]), ("worker:1", [0])):
        directory = tmp_path / task.replace(":", "-")
        callback = backup.WorkerBackup(str(directory), run="run-a", task=task, steps_per_epoch=10,
                                       every_steps=5)
        callback.set_model(_model())
        for step in steps:
            callback.step = step
            callback.save()
        rows.append(backup._describe_local(str(directory), "run-a", task))  # pylint: disable=protected-access
    assert backup.decide(np.array(rows)) == 0
    rows[1] = backup._describe_local(str(tmp_path / "lost"), "run-a", "worker:1")  # A disk lost: no backup.
    assert backup.decide(np.array(rows)) == 5  # worker:0's step; worker:1 gets its state (share_state).


def _row(job, index, status, *steps):
    return [job, index, status, *([-1] * (2 - len(steps)) + list(steps))]


def test_decide_takes_the_latest_step_all_workers_hold():
    assert backup.decide(np.array([_row(1, 0, 0), _row(1, 1, 0)])) == 0
    assert backup.decide(np.array([_row(1, 0, 1, 100, 120), _row(1, 1, 1, 80, 100)])) == 100
    assert backup.decide(np.array([_row(0, 0, 1, 100, 120), _row(1, 0, 1, 100, 120)])) == 120


def test_a_worker_without_a_backup_resumes_at_the_step_its_peers_hold():
    """A host that lost its disk, or one added to the job: it gets the state, not an error."""
    assert backup.decide(np.array([_row(0, 0, 1, 40, 80), _row(1, 0, 0)])) == 80
    assert backup.decide(np.array([_row(1, 0, 1, 40, 60), _row(1, 1, 1, 60, 80), _row(1, 2, 0)])) == 60


@pytest.mark.parametrize("rows, error", [
    ([_row(1, 0, 1, 40), _row(1, 1, 2, 40)],
     "Cannot resume: worker:1 holds a backup of a different run"),
    ([_row(1, 0, 1, 100, 120), _row(1, 1, 1, 40, 60)],
     "no step that every worker holds (worker:0 holds steps [100, 120]; worker:1 holds steps [40, 60])"),
])
def test_decide_refuses_backups_that_do_not_agree(rows, error):
    with pytest.raises(backup.ResumeError) as raised:
        backup.decide(np.array(rows))
    assert error in str(raised.value)


def test_a_layout_without_the_tasks_that_wrote_the_backups_resumes_from_theirs(tmp_path):
    """Two workers backed up, then one process (chief:0) starts: it resumes from their step
    instead of from 0. A task of the layout reports its own, even an empty one (a grow)."""
    for task in ("worker:0", "worker:1"):
        callback = backup.WorkerBackup(str(tmp_path / backup.task_dirname(task)), run="run-a", task=task,
                                       steps_per_epoch=10, every_steps=5)
        callback.set_model(_model())
        for step in (5, 10):
            callback.step = step
            callback.save()
    other = backup.WorkerBackup(str(tmp_path / "worker-2"), run="run-b", task="worker:2", steps_per_epoch=10)
    other.set_model(_model())
    other.step = 20
    other.save()  # Another run's, with a later step: never taken for this one.
    assert backup.resume_source(str(tmp_path / "chief-0"), run="run-a", tasks=["chief:0"]) == str(tmp_path / "worker-0")
    two = ["worker:0", "worker:1"]
    assert backup.resume_source(str(tmp_path / "worker-1"), run="run-a", tasks=two) == str(tmp_path / "worker-1")
    grown = [*two, "worker:3"]
    assert backup.resume_source(str(tmp_path / "worker-3"), run="run-a", tasks=grown) == str(tmp_path / "worker-3")
    restored = _model()
    assert backup.agree_on_resume(restored, str(tmp_path / "worker-0"), run="run-a", task="chief:0") == 10
    backup.remove_gone(str(tmp_path / "chief-0"), run="run-a", tasks=["chief:0"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-2"]  # Only the other run's is left.


def test_two_processes_of_one_task_never_hold_its_backups_at_once(tmp_path):
    """Issue 33 item 6: under Ray a stopping child ran on beside the new group's child of the
    same task, in the same backup/<task>, and its pruning could delete the agreed step."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    code = ("import sys, time; from distrib_tf.keras import backup; held = backup.hold(sys.argv[1]); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))")
    old = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout.readline().strip() == "held"
        with pytest.raises(backup.ResumeError, match="another process still holds"):
            backup.hold(str(tmp_path), wait_seconds=0.5)
        started = time.monotonic()
        held = backup.hold(str(tmp_path), wait_seconds=30)  # Waits for the old one to let go (it ends).
        waited = time.monotonic() - started
        os.close(held)
        assert waited > 1.5, waited  # It held on for 3 s after saying so, 0.5 s of them spent above.
        assert old.wait(timeout=30) == 0
    finally:
        old.kill()
        old.wait()
        old.stdout.close()


def test_a_backup_another_worker_deleted_first_is_no_error(tmp_path, monkeypatch):
    """Issue 42 item 2: workers that resumed from one gone task's backups all delete them at
    their clean end; the one that came second got FileNotFoundError (exit 1, then a retry
    from step 0)."""
    for name in ("step-000000004.json", "step-000000004.weights.h5"):
        (tmp_path / "worker-2" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "worker-2" / name).write_text("{}")
    listed = backup.glob.glob
    monkeypatch.setattr(backup.glob, "glob", lambda pattern: [*listed(pattern), str(tmp_path / "worker-2" /
                                                                                  "step-000000008.json")])
    backup.remove_backups(str(tmp_path / "worker-2"))  # The listed step 8 is gone already.
    assert not (tmp_path / "worker-2").exists()
