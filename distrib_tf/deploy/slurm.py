"""Slurm: the cluster of a job step from the `SLURM_*` variables, and the batch script that starts one.

`distrib-tf-launch --slurm`, run once per Slurm task by `srun`, builds the same cluster in
every task without talking to the others:

- Task `i` is Slurm task `i` (`SLURM_PROCID`), a `worker` (worker 0 acts as chief), on
  the node where Slurm's default block distribution puts it. The task checks that this
  agrees with its own `SLURM_NODEID` and `SLURM_LOCALID` (a cyclic distribution is refused).
- Host lists are expanded by Slurm's own `scontrol show hostnames`, so every form Slurm
  writes (`rack[1-2]-n[01-04]`, `a[1,3-5],b`) means what Slurm means.
- Ports: the step's reserved ports when Slurm reserves them (`SLURM_STEP_RESV_PORTS`,
  with `MpiParams=ports=...` in slurm.conf; the batch scripts ask `srun --resv-ports`), the
  local task `l` of every node taking the `l`-th. Without a reservation, a block of ports in
  20000-32767, below Linux's default ephemeral range, chosen by job id and step id: two
  steps of one job, or two jobs less than `(32768 - 20000) / (16 * tasks per node)` ids
  apart, never share one. Reserve ports where jobs are older than that.
- A single-node step talks over 127.0.0.1.

Every inconsistency is one `ClusterSpecError` line.

`batch_script` (`distrib-tf-export slurm`) writes a batch script that runs one task per
Slurm task through `distrib-tf-launch --slurm`; it asks Slurm for SIGTERM two minutes
before a time limit or preemption (`--signal=TERM@120`) and requeues itself when the job
exits 75. With `nodes=(MIN, MAX)` (`--nodes=MIN-MAX`) it asks for an allocation of any size
in that range and a number of tasks per node instead of a fixed count: a requeue that gets
another number of nodes resumes there (every worker of the new size agrees on the step the
old one backed up; `distrib_tf.keras.backup`), as long as its task count divides the global
batch (else the job exits 2 and says so).

No TensorFlow here.
"""

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping

from distrib_tf import exit_codes
from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import ClusterSpecError
from distrib_tf.cluster import Task
from distrib_tf.deploy import launcher_grace

SOURCE = "the SLURM_* environment"
PORT_RANGE = (20000, 32768)
STEPS_PER_JOB = 16  # Steps of one job with distinct fallback ports.


def _invalid(name: str, received, expected: str) -> ClusterSpecError:
    return ClusterSpecError(f"Invalid value for `{name}` in {SOURCE}. Received: {received!r}. "
                            f"Expected {expected}.")


def hostnames(hostlist: str) -> list[str]:
    """The host names of a Slurm host list, expanded by `scontrol show hostnames`."""
    if "[" not in hostlist:
        return [h for h in hostlist.split(",") if h]
    if shutil.which("scontrol") is None:
        raise _invalid("SLURM_STEP_NODELIST", hostlist, "to run where Slurm's `scontrol` is on PATH")
    try:
        result = subprocess.run(["scontrol", "show", "hostnames", hostlist],
                                capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        result = None
    if result is None or result.returncode != 0 or not result.stdout.split():
        why = "timed out" if result is None else (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise _invalid("SLURM_STEP_NODELIST", hostlist, f"a host list `scontrol` expands ({why})")
    return result.stdout.split()


def tasks_per_node(text: str) -> list[int]:
    """`2(x3),1` (Slurm's tasks per node) into `[2, 2, 2, 1]`.

    Raises:
        ValueError: not in that form.
    """
    counts = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.removesuffix(")") or 1)
    return counts


def reserved_ports(text: str) -> list[int]:
    """`12000-12002,12007` (Slurm's reserved ports) into `[12000, 12001, 12002, 12007]`."""
    ports = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        ports += range(int(low), int(high or low) + 1)
    return ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default.


def step_ports(environ: Mapping[str, str], width: int) -> list[int]:
    """The `width` ports of this step on each node: reserved by Slurm, else by job and step id."""
    if "SLURM_STEP_RESV_PORTS" in environ:
        text = environ["SLURM_STEP_RESV_PORTS"]
        try:
            ports = reserved_ports(text)
        except ValueError:
            raise _invalid("SLURM_STEP_RESV_PORTS", text, "port ranges such as '12000-12003'") from None
        if len(ports) < width:
            raise _invalid("SLURM_STEP_RESV_PORTS", text,
                           f"at least {width} ports, one per task on a node (srun --resv-ports={width})")
        return ports[:width]
    try:
        job, step = int(environ.get("SLURM_JOB_ID", "0")), int(environ.get("SLURM_STEP_ID", "0"))
    except ValueError:
        raise _invalid("SLURM_JOB_ID", environ.get("SLURM_JOB_ID"), "integer job and step ids") from None
    low, high = PORT_RANGE
    slots = (high - low) // width
    base = low + ((job * STEPS_PER_JOB + step % STEPS_PER_JOB) % slots) * width
    ports = list(range(base, base + width))
    ephemeral = _ephemeral_range()
    if any(ephemeral[0] <= p <= ephemeral[1] for p in ports):
        raise _invalid("SLURM_STEP_RESV_PORTS", None,
                       f"reserved ports (srun --resv-ports, MpiParams=ports=... in slurm.conf): this "
                       f"node's ephemeral ports {ephemeral[0]}-{ephemeral[1]} overlap the fallback "
                       f"ports {ports[0]}-{ports[-1]}")
    return ports


def _integer(environ: Mapping[str, str], *names: str) -> int:
    for name in names:
        if name in environ:
            try:
                return int(environ[name])
            except ValueError:
                raise _invalid(name, environ[name], "an integer") from None
    raise ClusterSpecError(f"Missing `{names[0]}` in {SOURCE}. Expected to run inside `srun` "
                           "(a Slurm job step).")


def load_cluster(environ: Mapping[str, str] | None = None) -> tuple[ClusterSpec, Task]:
    """The cluster of this Slurm step and this process's task.

    Raises:
        ClusterSpecError: not inside a Slurm step, or variables that disagree.
    """
    environ = os.environ if environ is None else environ
    procid = _integer(environ, "SLURM_PROCID")
    ntasks = _integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodelist_name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    counts_name = ("SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ
                   else "SLURM_TASKS_PER_NODE")
    if nodelist_name not in environ or counts_name not in environ:
        raise ClusterSpecError(f"Missing `SLURM_STEP_NODELIST` or `SLURM_STEP_TASKS_PER_NODE` in "
                               f"{SOURCE}. Expected to run inside `srun` (a Slurm job step).")
    nodes = hostnames(environ[nodelist_name])
    try:
        per_node = tasks_per_node(environ[counts_name])
    except ValueError:
        raise _invalid(counts_name, environ[counts_name], "counts such as '2(x3),1'") from None
    if len(per_node) != len(nodes) or sum(per_node) != ntasks:
        raise _invalid(counts_name, environ[counts_name],
                       f"{len(nodes)} counts (one per node of {nodelist_name}={environ[nodelist_name]!r}) "
                       f"adding up to {ntasks} tasks")
    if not 0 <= procid < ntasks:
        raise _invalid("SLURM_PROCID", procid, f"0 to {ntasks - 1}, for a step of {ntasks} tasks")
    placed = [(node, local) for node, count in enumerate(per_node) for local in range(count)]
    node_id, local_id = placed[procid]
    found = (_integer(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else node_id,
             _integer(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else local_id)
    if found != (node_id, local_id):
        raise _invalid("SLURM_NODEID, SLURM_LOCALID", found,
                       f"{(node_id, local_id)} for task {procid} placed block by block (srun's default "
                       f"distribution; SLURM_DISTRIBUTION={environ.get('SLURM_DISTRIBUTION')!r} is not "
                       "supported)")
    ports = step_ports(environ, max(per_node))
    addresses = [f"{'127.0.0.1' if len(nodes) == 1 else nodes[node]}:{ports[local]}"
                 for node, local in placed]
    spec = ClusterSpec({"worker": tuple(addresses)}, source=SOURCE)
    return spec, spec.check_task(Task("worker", procid))


def local_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """`(SLURM_LOCALID, tasks of this step on this node)`, or `None` outside Slurm.

    Raises:
        ValueError: variables that disagree.
    """
    if "SLURM_LOCALID" not in environ:
        return None
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    try:
        local, node = int(environ["SLURM_LOCALID"]), int(environ.get("SLURM_NODEID", "0"))
        count = tasks_per_node(counts)[node]
        if not 0 <= local < count:
            raise ValueError(local)
        return local, count
    except (ValueError, IndexError):
        raise ValueError(
            "Invalid value for `SLURM_LOCALID`, `SLURM_NODEID` or `SLURM_STEP_TASKS_PER_NODE` in "
            f"{SOURCE}. Received: {environ.get('SLURM_LOCALID')!r}, {environ.get('SLURM_NODEID')!r}, "
            f"{counts!r}. Expected a local id below this node's task count.") from None


SIGNAL_SECONDS = 120  # `--signal=TERM@120`: the warning before a time limit or a preemption.


JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def parse_nodes(text: str) -> tuple[int, int]:
    """`"2"` -> (2, 2); `"1-4"` -> (1, 4), Slurm's `--nodes=MIN-MAX`. Pure.

    Raises:
        ValueError: not `N` or `MIN-MAX` with 1 <= MIN <= MAX.
    """
    low, dash, high = text.partition("-")
    if low.isdigit() and (high.isdigit() if dash else True) and 1 <= int(low) <= int(high or low):
        return int(low), int(high or low)
    raise ValueError(f"Invalid value for `--nodes`. Received: {text!r}. Expected N, or MIN-MAX (an allocation of "
                     "any size in that range) with 1 <= MIN <= MAX.")


def batch_script(spec: ClusterSpec | None, *, command: list[str], job_name: str = "distrib_tf",
                 nodes: tuple[int, int] | None = None, tasks_per_node: int = 1,
                 launcher_options: tuple[str, ...] = ()) -> str:
    """An `sbatch` script running one Slurm task per training task of `spec`, or, with
    `nodes=(MIN, MAX)`, `tasks_per_node` tasks on each node of whatever allocation in that
    range Slurm grants (each requeue may get another size). `launcher_options` go to each
    task's `distrib-tf-launch` (a sweep's trial adds `--events=FILE` on a shared disk).

    Raises:
        ValueError: a `job_name` that is not letters, digits, `_`, `.` or `-` (it goes into
            an `#SBATCH` line and, through `%x`, into the output file's name); neither or
            both of `spec` and `nodes`.
    """
    if not JOB_NAME.match(job_name):
        raise ValueError(f"Invalid value for `--job_name`. Received: {job_name!r}. Expected letters, digits, "
                         "'_', '.' or '-' (at most 128), starting with a letter or digit.")
    if (spec is None) == (nodes is None):
        raise ValueError("Invalid arguments: received " + ("both `--cluster_spec` and `--nodes`" if nodes else
                         "neither `--cluster_spec` nor `--nodes`") + ". Expected one: a fixed number of tasks "
                         "(`--cluster_spec`), or an allocation of MIN-MAX nodes (`--nodes`).")
    if nodes is None:
        size = [f"#SBATCH --ntasks={spec.num_workers}"]
    else:
        if tasks_per_node < 1:
            raise ValueError(f"Invalid value for `--tasks_per_node`. Received: {tasks_per_node}. Expected an "
                             "integer >= 1.")
        low, high = nodes
        size = [f"#SBATCH --nodes={low}-{high}" if low < high else f"#SBATCH --nodes={low}",
                f"#SBATCH --ntasks-per-node={tasks_per_node}"]
    elastic = [] if nodes is None or nodes[0] == nodes[1] else [
        f"# Any allocation of {nodes[0]} to {nodes[1]} nodes: a requeue onto another size resumes where this",
        "# one stopped, if its task count divides the global batch (else exit 2, nothing lost)."]
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        *size,
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --output=%x-%j.out",
        f"#SBATCH --signal=TERM@{SIGNAL_SECONDS}",
        "#SBATCH --requeue",
        "# One TensorFlow task per Slurm task; TF_CONFIG comes from the SLURM_* variables.",
        *elastic,
        f"# --wait stops the other tasks {SIGNAL_SECONDS} s after the first one ends (not at once, as",
        f"# --kill-on-bad-exit would for an exit {exit_codes.PREEMPTED}, while the others still back up).",
        "# SIGTERM (120 s before a time limit or a preemption) makes every worker back up one",
        f"# agreed step and exit {exit_codes.PREEMPTED}; the job then requeues itself and resumes at that step.",
        f"srun --wait={SIGNAL_SECONDS} "
        + shlex.join(["distrib-tf-launch", "--slurm", f"--grace_period={launcher_grace(SIGNAL_SECONDS)}",
                      *launcher_options, "--", *command]),
        "code=$?",
        f'if [ "$code" -eq {exit_codes.PREEMPTED} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"',
        "",
    ])
