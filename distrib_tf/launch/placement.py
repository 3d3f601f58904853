"""Where each task of a host runs: its local rank and its GPUs, like torchrun's `LOCAL_RANK`.

Every task started on a host gets a local rank: `SLURM_LOCALID` under Slurm, else its
order among the tasks this launcher starts, counted from `--local_rank_offset` among
`--local_world_size` tasks when several launchers share the host (a sweep's trials side
by side): their GPUs and CPUs are then disjoint shares of one split. The tasks share the GPUs the launcher was
given: its own `CUDA_VISIBLE_DEVICES` when set (Slurm and Kubernetes hand out GPUs that
way), else every GPU `nvidia-smi -L` lists. Then:

- `--gpus_per_task=N`: local rank r gets the GPUs r*N ... r*N+N-1 of that list;
- no flag, several local tasks and GPUs present: they are split evenly (refused in one
  line when they do not divide);
- no flag and one local task: the environment is left alone;
- under Slurm's `--gpus-per-task` (`SLURM_GPUS_PER_TASK`), what a task sees is its own:
  it is not shared out again.

Several local tasks also share the CPUs the launcher may use (its affinity): each gets
an equal, contiguous share (`cpus_for`), which `distrib_tf.launch._task_init` binds it to
(`CPUS_ENV`), and thread pools of that size: `OMP_NUM_THREADS` and
`TF_NUM_INTRAOP_THREADS` the share, `TF_NUM_INTEROP_THREADS` at most 2. Without this each
of N tasks sizes its pools to every core, and N times too many threads preempt each
other in the middle of a collective. A variable the user set wins; with fewer CPUs than
tasks there is no binding, and one thread each.

Each task's environment gets `LOCAL_RANK` and `LOCAL_WORLD_SIZE`, and `CUDA_VISIBLE_DEVICES`
when GPUs were placed. No TensorFlow here.

Example:

    >>> gpus_for(local_rank=1, local_tasks=2, visible=["4", "5", "6", "7"], gpus_per_task=0)
    ['6', '7']
"""

import shutil
import subprocess
from collections.abc import Mapping

CPUS_ENV = "DISTRIB_TF_CPUS"  # The CPUs a task is bound to, "0,1"; read by `_task_init`.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this launcher may hand out: its `CUDA_VISIBLE_DEVICES`, else those it sees."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def gpus_for(*, local_rank: int, local_tasks: int, visible: list[str], gpus_per_task: int) -> list[str] | None:
    """The GPUs of `local_rank`, or `None` to leave `CUDA_VISIBLE_DEVICES` alone.

    Raises:
        ValueError: the GPUs asked for do not fit the ones visible, or do not divide.
    """
    shown = f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}" if visible else "no GPU"
    if gpus_per_task:
        if local_tasks * gpus_per_task > len(visible):
            raise ValueError(
                f"Invalid value for `--gpus_per_task`. Received: {gpus_per_task} for each of "
                f"{local_tasks} task(s) on this host, while the launcher sees {shown}. Expected "
                f"at most {len(visible) // max(local_tasks, 1)} GPU(s) per task.")
        return visible[local_rank * gpus_per_task:(local_rank + 1) * gpus_per_task]
    if local_tasks < 2 or not visible:
        return None
    if len(visible) % local_tasks:
        raise ValueError(
            f"Invalid value for `--gpus_per_task`. Received: none, with {local_tasks} tasks on this "
            f"host sharing {len(visible)} GPUs ({shown}), which do not divide evenly. Expected "
            "--gpus_per_task=N with N times the tasks at most the GPUs.")
    share = len(visible) // local_tasks
    return visible[local_rank * share:(local_rank + 1) * share]


def cpus_for(*, local_rank: int, local_tasks: int, cpus: list[int]) -> list[int]:
    """The CPUs of `local_rank`: an equal, contiguous share of `cpus` (the rest unused), or
    none when there are fewer CPUs than tasks. Pure.

    Example:

        >>> cpus_for(local_rank=1, local_tasks=2, cpus=[0, 1, 2, 3, 4])
        [2, 3]
    """
    share = len(cpus) // max(local_tasks, 1)
    return sorted(cpus)[local_rank * share:(local_rank + 1) * share]


def threads_env(*, local_rank: int, local_tasks: int, cpus: list[int], environ: Mapping[str, str]) -> dict[str, str]:
    """CPU binding and thread pools for one of `local_tasks` tasks sharing `cpus`. Pure.

    Example:

        >>> threads_env(local_rank=1, local_tasks=2, cpus=[0, 1, 2, 3], environ={})
        {'DISTRIB_TF_CPUS': '2,3', 'OMP_NUM_THREADS': '2', 'TF_NUM_INTRAOP_THREADS': '2', 'TF_NUM_INTEROP_THREADS': '2'}
    """
    if local_tasks < 2:
        return {}
    mine = cpus_for(local_rank=local_rank, local_tasks=local_tasks, cpus=cpus)
    threads = max(len(mine), 1)
    env = {CPUS_ENV: ",".join(map(str, mine))} if mine and CPUS_ENV not in environ else {}
    for name, count in zip(THREAD_VARIABLES, (threads, threads, min(threads, 2))):
        if name not in environ:
            env[name] = str(count)
    return env


def placement_env(*, local_rank: int, local_tasks: int, visible: list[str], gpus_per_task: int,
                  bound_per_task: bool = False, cpus: list[int] | None = None,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a task gets for its place on this host. Pure.

    `bound_per_task`: the GPUs visible are this task's alone (Slurm's `--gpus-per-task`),
    so they are not shared out again. `cpus`: the CPUs the launcher may use, shared out
    among the local tasks (`threads_env`); `environ`: the user's, whose variables win.
    """
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_tasks)}
    rank, tasks = (0, 1) if bound_per_task else (local_rank, local_tasks)
    gpus = gpus_for(local_rank=rank, local_tasks=tasks, visible=visible, gpus_per_task=gpus_per_task)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if cpus:
        env.update(threads_env(local_rank=rank, local_tasks=tasks, cpus=cpus, environ=environ or {}))
    return env
