"""Local ranks and GPUs: what each task's environment receives (no GPU needed)."""

import json
import os
import subprocess
import sys

import pytest

from distrib_tf.launch import placement

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.parametrize("visible, per_task, tasks, expected", [
    (["4", "5", "6", "7"], 2, 2, [["4", "5"], ["6", "7"]]),  # The launcher's own list, not 0..N.
    (["0", "1", "2", "3"], 1, 2, [["0"], ["1"]]),
    (["GPU-a", "GPU-b"], 0, 2, [["GPU-a"], ["GPU-b"]]),  # No flag: split evenly.
    (["0", "1", "2", "3"], 0, 1, [None]),  # One task, no flag: left alone.
    ([], 0, 2, [None, None]),  # No GPU: left alone.
])
def test_gpus_follow_the_local_rank(visible, per_task, tasks, expected):
    got = [placement.gpus_for(local_rank=r, local_tasks=tasks, visible=visible, gpus_per_task=per_task)
           for r in range(tasks)]
    assert got == expected


@pytest.mark.parametrize("visible, per_task, tasks, message", [
    (["0", "1", "2"], 2, 2, "Received: 2 for each of 2 task(s) on this host, while the launcher sees "
                            "CUDA_VISIBLE_DEVICES='0,1,2'. Expected at most 1 GPU(s) per task."),
    (["0", "1", "2"], 0, 2, "with 2 tasks on this host sharing 3 GPUs"),
    ([], 1, 1, "while the launcher sees no GPU"),
])
def test_gpus_that_do_not_fit_are_refused(visible, per_task, tasks, message):
    with pytest.raises(ValueError) as raised:
        placement.gpus_for(local_rank=0, local_tasks=tasks, visible=visible, gpus_per_task=per_task)
    assert message in str(raised.value)


def _launch_env(tmp_path, gpus, *options):
    """Runs two local tasks that print their environment; returns it per task."""
    code = ("import json, os; print('ENV ' + json.dumps({k: os.environ.get(k) for k in "
            "('LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'CUDA_VISIBLE_DEVICES')}))")
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": gpus}
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
         *options, "--", sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    seen = {line.split("] ENV ")[0][1:]: json.loads(line.split("] ENV ")[1])
            for line in result.stdout.splitlines() if "] ENV " in line}
    return result, seen


def test_each_task_receives_its_rank_and_gpus(tmp_path):
    result, seen = _launch_env(tmp_path, "3,5,6,9", "--gpus_per_task=2")
    assert result.returncode == 0, result.stdout[-2000:]
    assert seen == {
        "worker:0": {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3,5"},
        "worker:1": {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "6,9"},
    }


def test_gpus_that_do_not_divide_start_nothing(tmp_path):
    result, seen = _launch_env(tmp_path, "0,1,2")
    assert result.returncode == 2 and not seen and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "with 2 tasks on this host sharing 3 GPUs" in lines[0], result.stderr


@pytest.mark.parametrize("bound, expected", [
    ({}, "7"),  # The node's GPUs, shared out by SLURM_LOCALID.
    ({"SLURM_GPUS_PER_TASK": "2"}, "6,7"),  # Slurm bound them to this task: kept.
])
def test_under_slurm_the_local_rank_is_slurms(bound, expected):
    code = ("import os; print('ENV', os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], "
            "os.environ['CUDA_VISIBLE_DEVICES'])")
    step = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "n1",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "1"}
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "6,7", **step, **bound}
    result = subprocess.run([sys.executable, "-m", "distrib_tf.launch", "--slurm", "--", sys.executable, "-c", code],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[worker:1] ENV 1 2 {expected}" in result.stdout
