"""The resume agreement's parts that need no cluster (tests/test_backup.py restores through it
in one process; tests/test_run.py grows 2 workers onto 3 across disks)."""

import json

import numpy as np

from distrib_tf.keras import resume


def _row(task, meta):
    job, index = task.split(":")
    size = len(json.dumps(meta, sort_keys=True).encode()) if meta else 0
    return np.array([resume._JOB_CODES[job], int(index), 1 if meta else 0, meta["step"] if meta else -1, size,  # pylint: disable=protected-access
                     bool(meta)], dtype=np.int64)


def test_only_the_sources_worker_sends_metadata_every_worker_one_length():
    """Issue 53: two holders of step 7 whose metadata differ in length (the task's name, each
    one's own metric sums inside the epoch) and a worker on an empty disk. Each holder used
    to send its own metadata: tensors of different shapes in one all-reduce."""
    metas = {"chief:0": {"run": "r", "step": 7, "task": "chief:0", "metrics": [[1.5, 2.0]]},
             "worker:1": {"run": "r", "step": 7, "task": "worker:1", "metrics": [[10.25, 2.0]]},
             "worker:2": None}
    rows = np.stack([_row(task, meta) for task, meta in metas.items()])
    assert rows[0][4] != rows[1][4]
    sent = {task: resume._metadata_sent(rows, _row(task, meta), source=0, meta=meta)  # pylint: disable=protected-access
            for task, meta in metas.items()}
    assert {len(s) for s in sent.values()} == {rows[0][4]}  # One shape on every worker.
    assert json.loads(sum(sent.values()).astype(np.uint8).tobytes()) == metas["chief:0"]  # The source's, whole.
    assert not sent["worker:1"].any() and not sent["worker:2"].any()
