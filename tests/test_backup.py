"""Per-worker backups: torn writes, and the one resume point every worker agrees on."""

import functools
import hashlib
import json
import os
import threading

import keras
import numpy as np
import pytest

from distrib_tf.keras import backup
from distrib_tf.keras import resume
from distrib_tf.keras import worker_backup


class KilledWhileWriting(Exception):
    pass


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _callback(directory, model, every_steps=None):
    callback = worker_backup.WorkerBackup(str(directory), run="run-a", task="chief:0", steps_per_epoch=4,
                                   every_steps=every_steps)
    callback.set_model(model)
    return callback


def _torn(path, arrays):
    with open(f"{path}.writing", "wb") as f:
        f.write(np.asarray(arrays[0]).tobytes()[:100])  # Part of the state, as a SIGKILL leaves it.
    raise KilledWhileWriting()


def _metadata_lost(path, arrays):
    backup.write_state.__wrapped__(path, arrays)  # The state whole, renamed into place...
    raise KilledWhileWriting()  # ...and the process gone before its metadata.


@pytest.mark.parametrize("moment", ["copy", "write", "metadata"])
def test_killed_at_any_moment_of_a_backup_resumes_the_newest_whole_one(tmp_path, monkeypatch, moment):
    """Issue 43 item 4: a process killed while the state is copied into memory (nothing
    submitted), while the background writer writes the weights (a torn `.writing` file), or
    between the weights' rename and the metadata: the backup of step 8 does not exist, and
    the resume restores step 4 exactly."""
    tmp_path = tmp_path / "chief-0"  # Inside model_dir/backup/.
    model = _model()
    first = [w.copy() for w in model.get_weights()]
    callback = _callback(tmp_path, model)
    callback.step = 4
    callback.on_epoch_end(0)
    callback.flush()
    model.set_weights([w + 1 for w in first])
    callback.step = 8
    if moment == "copy":
        monkeypatch.setattr(worker_backup, "snapshot", lambda v: (_ for _ in ()).throw(KilledWhileWriting()))
    else:
        write = backup.write_state
        fault = _torn if moment == "write" else _metadata_lost
        monkeypatch.setattr(backup, "write_state", functools.wraps(write)(fault))
    with pytest.raises(KilledWhileWriting):
        callback.on_epoch_end(1)
        callback.flush()  # The writer's error comes out here.
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [4]
    assert (tmp_path / "step-000000008.state").exists() == (moment == "metadata")
    restored = _model()
    assert resume.agree_on_resume(restored, str(tmp_path), run="run-a", task="chief:0").step == 4
    for a, b in zip(restored.get_weights(), first):
        np.testing.assert_array_equal(a, b)


def test_a_backup_waits_only_for_its_copy_and_the_next_one_for_the_write_before(tmp_path, monkeypatch):
    """The step waits while the state is copied; the write runs on; a second backup asked for
    while the first is written waits for it (one copy in memory at most)."""
    tmp_path = tmp_path / "chief-0"
    gate, write = threading.Event(), backup.write_state

    def slow_write(path, arrays):
        assert gate.wait(30)
        return write(path, arrays)

    monkeypatch.setattr(backup, "write_state", slow_write)
    callback = _callback(tmp_path, _model())
    callback.step = 4
    callback.on_epoch_end(0)  # Returns with its write held back.
    assert backup.list_backups(str(tmp_path)) == []
    waiting = threading.Thread(target=lambda: (setattr(callback, "step", 8), callback.on_epoch_end(1)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()  # The second waits for the first write.
    gate.set()
    waiting.join(30)
    callback.flush()
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [4, 8]
    assert len(callback.blocked_seconds) == 2 and callback.blocked_seconds[1] >= 0.5


def test_keeps_the_last_two_and_saves_every_n_steps(tmp_path):
    tmp_path = tmp_path / "chief-0"
    model = _model()
    callback = _callback(tmp_path, model, every_steps=3)
    callback.on_train_begin()
    for batch in range(8):
        model.optimizer.iterations.assign_add(1)  # A step, as Keras's train step counts it.
        callback.on_train_batch_end(batch)
        if batch % 4 == 3:
            callback.on_epoch_end(batch // 4)
    callback.flush()
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [6, 8]
    meta = json.loads((tmp_path / "step-000000008.json").read_text())
    state = tmp_path / "step-000000008.state"
    assert meta == {"run": "run-a", "step": 8, "epoch": 2, "task": "chief:0", "bytes": state.stat().st_size,
                    "sha256": hashlib.sha256(state.read_bytes()).hexdigest(),
                    "variables": backup.describe_variables(backup.state_variables(model)),
                    "history": [{"epoch": 1}, {"epoch": 2}], "callbacks": [], "stopped": False, "rollbacks": []}
    assert [v[0].split("/")[-1] for v in meta["variables"]] == ["kernel", "bias", "iteration", "learning_rate"]
    backup.remove_backups(str(tmp_path))
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncated", "bit flipped"])
def test_weights_damaged_after_a_crash_fall_back_to_the_backup_before(tmp_path, damage):
    tmp_path = tmp_path / "chief-0"
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
    callback.flush()
    weights = tmp_path / "step-000000008.state"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else
                        data[:8] + bytes([data[8] ^ 1]) + data[9:])
    assert [b["step"] for b in backup.list_backups(str(tmp_path))] == [4]
    restored = _model()
    assert resume.agree_on_resume(restored, str(tmp_path), run="run-a", task="chief:0").step == 4
    for a, b in zip(restored.get_weights(), first):
        np.testing.assert_array_equal(a, b)


def _save(directory, task, steps, run="run-a", model=None):
    callback = worker_backup.WorkerBackup(str(directory / backup.task_dirname(task)), run=run, task=task,
                                   steps_per_epoch=10, every_steps=5)
    callback.set_model(model or _model())
    for step in steps:
        callback.step = step
        callback.save()
    callback.flush()
    return callback


def _rows(directory, tasks, run="run-a"):
    rows = []
    for task in tasks:
        own = str(directory / backup.task_dirname(task))
        rows.append(resume._describe_local(own, run, task, resume.newest(own, run=run)))  # pylint: disable=protected-access
    return np.array(rows)


def test_a_worker_killed_writing_a_backup_resumes_at_its_peers_newer_one(tmp_path):
    """worker:0 holds the start and step 5; worker:1 was killed while writing step 5: every
    worker resumes at 5, worker:1 receiving it (it was a ResumeError, then a restart at 0)."""
    _save(tmp_path / "a", "worker:0", [0, 5])
    _save(tmp_path / "b", "worker:1", [0])  # Own disks: neither sees the other's.
    assert resume.decide(np.concatenate([_rows(tmp_path / "a", ["worker:0"]),
                                         _rows(tmp_path / "b", ["worker:1"])])) == 5
    assert resume.decide(_rows(tmp_path / "c", ["worker:0", "worker:1"])) == 0  # Nothing anywhere: step 0.


@pytest.mark.parametrize("history, tasks, expected", [
    # 2 workers to step 35, then 1 process to 101, then 2 workers again (shared disk): 101, not 35.
    ([("worker:0", [30, 35]), ("worker:1", [30, 35]), ("chief:0", [96, 101])], ["worker:0", "worker:1"], 101),
    # 1 process to 40, 2 workers to 70, 1 process again: 70 from the workers' directories.
    ([("chief:0", [35, 40]), ("worker:0", [65, 70]), ("worker:1", [65, 70])], ["chief:0"], 70),
    # 3 workers to 30, 2 to 60, 3 again: worker-2's stale 30 neither wins nor stops the job.
    ([("worker:0", [55, 60]), ("worker:1", [55, 60]), ("worker:2", [25, 30])],
     ["worker:0", "worker:1", "worker:2"], 60),
])
def test_the_newest_step_wins_whatever_the_history_of_layouts(tmp_path, history, tasks, expected):
    for task, steps in history:
        _save(tmp_path, task, steps)
    _save(tmp_path, "worker:5", [500], run="run-b")  # Another run's, with a later step: never this run's.
    assert resume.decide(_rows(tmp_path, tasks)) == expected
    restored = _model()
    resumed = resume.agree_on_resume(restored, str(tmp_path / backup.task_dirname(tasks[0])), run="run-a",
                                     task=tasks[0])
    assert (resumed.step, resumed.meta["step"]) == (expected, expected)


def test_own_disks_resume_at_the_newest_step_any_disk_holds(tmp_path):
    """2 workers on own disks, preempted at 35; 1 process on host a to 101; back on 2: host a
    reads 101 from chief-0's directory, host b holds 35 and receives 101."""
    for host, task in (("a", "worker:0"), ("b", "worker:1")):
        _save(tmp_path / host, task, [30, 35])
    _save(tmp_path / "a", "chief:0", [96, 101])
    rows = np.concatenate([_rows(tmp_path / "a", ["worker:0"]), _rows(tmp_path / "b", ["worker:1"])])
    assert resume.decide(rows) == 101
    assert resume.newest(str(tmp_path / "a" / "worker-0"), run="run-a").directory == str(tmp_path / "a" / "chief-0")


def test_a_task_prefers_its_own_backup_of_the_newest_step(tmp_path):
    first, second = _model(), _model()
    _save(tmp_path, "worker:0", [5], model=first)
    _save(tmp_path, "worker:1", [5], model=second)
    found = resume.newest(str(tmp_path / "worker-1"), run="run-a")
    assert (found.directory, found.meta["task"]) == (str(tmp_path / "worker-1"), "worker:1")


def test_decide_refuses_another_runs_backups_in_a_tasks_own_directory(tmp_path):
    _save(tmp_path, "worker:0", [40])
    _save(tmp_path, "worker:1", [40], run="run-b")
    with pytest.raises(resume.ResumeError) as raised:
        resume.decide(_rows(tmp_path, ["worker:0", "worker:1"]))
    assert "Cannot resume: worker:1 holds a backup of a different run" in str(raised.value)


def test_gone_tasks_backups_go_once_a_newer_step_is_backed_up_and_fresh_start_clears_the_run(tmp_path):
    """4 workers backed up 10; 2 resume there: worker-2/3 are read, then deleted once worker:0
    backed up 15 (another run's beside them stay); fresh_start deletes what is left of the run."""
    for task in ("worker:0", "worker:1", "worker:2", "worker:3"):
        _save(tmp_path, task, [5, 10])
    _save(tmp_path, "worker:7", [20], run="run-b")
    two = ["worker:0", "worker:1"]
    callback = worker_backup.WorkerBackup(str(tmp_path / "worker-0"), run="run-a", task="worker:0", steps_per_epoch=10,
                                   layout=two)
    callback.set_model(_model())
    callback.step = 10
    callback.save()  # The resumed step itself: worker-2's 10 is as new, kept.
    callback.flush()
    assert backup.list_backups(str(tmp_path / "worker-2"))
    callback.step = 15
    callback.save()
    callback.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1", "worker-7"]
    assert backup.clear_run(str(tmp_path / "worker-0"), run="run-a") == [5, 10, 15]
    assert resume.newest(str(tmp_path / "worker-0"), run="run-a") is None
    assert [b["step"] for b in backup.list_backups(str(tmp_path / "worker-7"))] == [20]


def test_two_processes_of_one_task_never_hold_its_backups_at_once(tmp_path):
    """Issue 33 item 6: under Ray a stopping child ran on beside the new group's child of the
    same task, in the same backup/<task>, and its pruning could delete the agreed step."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    code = ("import sys, time; from distrib_tf.keras import resume; held = resume.hold(sys.argv[1]); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))")
    old = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout.readline().strip() == "held"
        with pytest.raises(resume.ResumeError, match="another process still holds"):
            resume.hold(str(tmp_path), wait_seconds=0.5)
        started = time.monotonic()
        held = resume.hold(str(tmp_path), wait_seconds=30)  # Waits for the old one to let go (it ends).
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
