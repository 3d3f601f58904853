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


@pytest.mark.parametrize("tasks, cpus, expected", [
    (2, [0, 1], [[0], [1]]),
    (2, [0, 1, 2, 3, 4], [[0, 1], [2, 3]]),  # Equal shares; the odd one out unused.
    (3, [4, 5], [[], [], []]),  # Fewer CPUs than tasks: no binding.
])
def test_cpus_are_shared_out_by_local_rank(tasks, cpus, expected):
    assert [placement.cpus_for(local_rank=r, local_tasks=tasks, cpus=cpus) for r in range(tasks)] == expected


def _launch_threads(extra_env, *options):
    """Two local tasks print their CPUs and thread variables; returns them per task."""
    code = ("import json, os; print('THREADS ' + json.dumps([sorted(os.sched_getaffinity(0))] + "
            "[os.environ.get(k) for k in ('OMP_NUM_THREADS', 'TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS')]))")
    env = {k: v for k, v in os.environ.items() if k not in placement.THREAD_VARIABLES}
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.launch", "--workers=2", *options, "--", sys.executable, "-c", code],
        env={**env, "PYTHONPATH": ROOT, **extra_env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {line.split("] THREADS ")[0][1:]: json.loads(line.split("] THREADS ")[1])
            for line in result.stdout.splitlines() if "] THREADS " in line}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to share out")
def test_local_tasks_get_their_share_of_the_cpus_and_threads_to_match():
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // 2
    threads = str(share)
    assert _launch_threads({}) == {
        "worker:0": [cpus[:share], threads, threads, str(min(share, 2))],
        "worker:1": [cpus[share:2 * share], threads, threads, str(min(share, 2))],
    }
    # The user's own values win, and the binding can be turned off.
    seen = _launch_threads({"OMP_NUM_THREADS": "7"}, "--no_cpu_binding")
    assert seen["worker:1"] == [cpus, "7", None, None]
    assert _launch_threads({"TF_NUM_INTRAOP_THREADS": "5"})["worker:0"] == [cpus[:share], threads, "5",
                                                                           str(min(share, 2))]


def test_launchers_side_by_side_take_disjoint_gpus_and_cpus():
    """Two 2-worker launchers on one host (a sweep's trials at once), the second from local
    rank 2 of 4: no GPU or CPU of one is the other's."""
    from distrib_tf import launch  # pylint: disable=import-outside-toplevel
    from distrib_tf.cluster import ClusterSpec  # pylint: disable=import-outside-toplevel

    spec = ClusterSpec.from_dict({"cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]}})
    taken = []
    for offset in (0, 2):
        config = launch.LaunchConfig(spec=spec, tasks=spec.tasks, command=("true",), local_rank_offset=offset,
                                     local_world_size=4, visible_gpus=("0", "1", "2", "3"), cpus=tuple(range(8)))
        for slot in range(2):
            env = launch.task_env(config, spec, spec.tasks[slot], slot, {})
            assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(offset + slot), "4")
            taken.append((env["CUDA_VISIBLE_DEVICES"], env[placement.CPUS_ENV], env["OMP_NUM_THREADS"]))
    assert taken == [("0", "0,1", "2"), ("1", "2,3", "2"), ("2", "4,5", "2"), ("3", "6,7", "2")]


def test_a_local_world_too_small_for_the_offset_is_refused():
    result = subprocess.run([sys.executable, "-m", "distrib_tf.launch", "--workers=2", "--local_rank_offset=2",
                             "--local_world_size=3", "--", "true"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert ("Invalid value for `--local_world_size`. Received: 3, with --local_rank_offset=2 and 2 task(s) here. "
            "Expected at least 4.") in result.stderr
