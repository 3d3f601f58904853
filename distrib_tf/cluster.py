"""Cluster specs: load, validate and turn into the `TF_CONFIG` of each task.

A cluster spec is the `cluster` part of `TF_CONFIG`, kept in a JSON file:

    {"cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]}}

Job names are `chief`, `worker` and `evaluator`. Port `0` (`"127.0.0.1:0"`) asks for a
free port, which `ClusterSpec.with_free_ports()` picks on this host. Every mistake is
reported as one `ClusterSpecError` line naming the file (or `TF_CONFIG`), the field,
what was received and what is expected, before anything reaches TensorFlow.

This module imports no TensorFlow: the launcher uses it to start processes.

Example:

    >>> spec = ClusterSpec.from_dict({"cluster": {"worker": ["127.0.0.1:0"] * 2}})
    >>> [str(task) for task in spec.tasks]
    ['worker:0', 'worker:1']
    >>> spec = spec.with_free_ports()
    >>> config = json.loads(spec.tf_config(Task("worker", 1)))
    >>> config["task"]
    {'type': 'worker', 'index': 1}
"""

import dataclasses
import functools
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

JOB_TYPES = ("chief", "worker", "evaluator")
# The kinds of strategy `distrib_tf.make_strategy` builds for a cluster (TensorFlow-free here,
# so that configs are checked without it).
STRATEGY_KINDS = ("auto", "one_device", "mirrored", "multi_worker")
_PS_HINT = (
    "Parameter-server training is out of scope for distrib_tf: use `chief` and "
    "`worker` tasks with a multi-worker strategy."
)


class ClusterSpecError(ValueError):
    """A cluster spec, `TF_CONFIG` or task name that cannot be used."""


def _invalid(field: str, source: str, received: Any, expected: str) -> ClusterSpecError:
    return ClusterSpecError(
        f"Invalid value for `{field}` in {source}. "
        f"Received: {received!r}. Expected {expected}."
    )


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterSpecError(
            f"Invalid JSON in {source} at line {e.lineno} column {e.colno}: {e.msg}."
        ) from e


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One task of a cluster: its job name and its index in that job."""

    type: str
    index: int

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


def parse_task(text: str, *, source: str = "--task") -> Task:
    """Parses `TYPE:INDEX` (for example `worker:1`) into a `Task`.

    Example:

        >>> parse_task("worker:1")
        Task(type='worker', index=1)
    """
    job, sep, index = str(text).partition(":")
    if not sep or job not in JOB_TYPES or not index.isdigit():
        raise _invalid(
            "task", source, text, f"TYPE:INDEX with TYPE one of {list(JOB_TYPES)}, "
            "for example 'worker:1'"
        )
    return Task(job, int(index))


SHIPPED_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_specs")


def shipped_specs() -> list[str]:
    """Names of the specs shipped with distrib_tf (`distrib_tf/cluster_specs/NAME.json`)."""
    return sorted(name[:-len(".json")] for name in os.listdir(SHIPPED_SPECS) if name.endswith(".json"))


def spec_path(name_or_path: str) -> str:
    """The file of a spec given by path, or by the name of a shipped spec.

    Raises:
        ClusterSpecError: neither a file nor a shipped spec's name.
    """
    if os.path.exists(name_or_path) or os.sep in name_or_path or name_or_path.endswith(".json"):
        return name_or_path
    if name_or_path in shipped_specs():
        return os.path.join(SHIPPED_SPECS, f"{name_or_path}.json")
    raise ClusterSpecError(
        f"Invalid value for `--cluster_spec`. Received: {name_or_path!r}. Expected a JSON spec "
        f"file or the name of a shipped spec: {', '.join(shipped_specs())}.")


def split_address(address: str) -> tuple[str, int]:
    """Splits `host:port` (or `[v6]:port`) into host and port, unchecked."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_address(address: Any, field: str, source: str) -> None:
    expected = "a 'host:port' string such as '127.0.0.1:2222' (port 0 picks a free port)"
    if not isinstance(address, str) or ":" not in address:
        raise _invalid(field, source, address, expected)
    host, _, port = address.rpartition(":")
    if not host.strip("[]"):
        raise _invalid(field, source, address, "a non-empty host before ':PORT'")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise _invalid(field, source, address, "a port number from 0 to 65535 after the host")


def _check_jobs(cluster: Any, source: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(cluster, dict) or not cluster:
        raise _invalid(
            "cluster", source, cluster,
            'a non-empty object of job lists, such as {"worker": ["127.0.0.1:0"]}',
        )
    seen: dict[str, str] = {}
    for job, addresses in cluster.items():
        if job == "ps":
            raise ClusterSpecError(
                f"Invalid value for `cluster.ps` in {source}. Received: a `ps` job. "
                f"{_PS_HINT}"
            )
        if job not in JOB_TYPES:
            raise _invalid("cluster", source, job, f"job names from {list(JOB_TYPES)}")
        if not isinstance(addresses, list) or not addresses:
            raise _invalid(f"cluster.{job}", source, addresses, "a non-empty list of 'host:port' strings")
        if job in ("chief", "evaluator") and len(addresses) > 1:
            raise _invalid(
                f"cluster.{job}", source, addresses, f"at most one {job} address"
            )
        for index, address in enumerate(addresses):
            field = f"cluster.{job}[{index}]"
            _check_address(address, field, source)
            if not address.endswith(":0") and address in seen:
                raise _invalid(
                    field, source, address,
                    f"an address not already used by `{seen[address]}`",
                )
            seen[address] = field
    if not any(job in cluster for job in ("chief", "worker")):
        raise _invalid(
            "cluster", source, sorted(cluster), "at least one `chief` or `worker` task"
        )
    return {job: tuple(cluster[job]) for job in JOB_TYPES if job in cluster}


@functools.cache
def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: an address a socket here can bind to."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The tasks of a cluster and their addresses, validated.

    Attributes:
        jobs: job name to the addresses of its tasks, in `JOB_TYPES` order.
        source: where the spec came from (a path or `TF_CONFIG`), for messages.
    """

    jobs: Mapping[str, tuple[str, ...]]
    source: str = "the cluster spec"

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "the cluster spec") -> "ClusterSpec":
        """Validates `{"cluster": {...}}` (the top level of a spec file)."""
        if not isinstance(data, dict):
            raise _invalid("(top level)", source, type(data).__name__, 'a JSON object with a "cluster" key')
        if "cluster" not in data:
            raise _invalid(
                "cluster", source, "no `cluster` key",
                'a "cluster" object, such as {"cluster": {"worker": ["127.0.0.1:0"]}}',
            )
        return cls(_check_jobs(data["cluster"], source), source)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ClusterSpec":
        """Loads and validates a JSON spec file.

        Example:

            >>> ClusterSpec.from_file("cluster_specs/local_2workers.json").num_workers
            2
        """
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ClusterSpecError(
                f"Cannot read cluster spec {source}: {e.strerror or e}. "
                "Expected a readable JSON file."
            ) from e
        return cls.from_dict(_parse_json(text, source), source=source)

    @classmethod
    def load(cls, name_or_path: str) -> "ClusterSpec":
        """A spec file, or a spec shipped with distrib_tf by name (`local_2workers`).

        Example:

            >>> ClusterSpec.load("local_2workers").num_workers
            2
        """
        return cls.from_file(spec_path(name_or_path))

    @classmethod
    def local_workers(cls, count: int) -> "ClusterSpec":
        """`count` workers on 127.0.0.1, each on a free port picked at launch."""
        return cls({"worker": ("127.0.0.1:0",) * count}, source=f"--workers={count}")

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task, chief first, then workers, then the evaluator."""
        return tuple(
            Task(job, index)
            for job, addresses in self.jobs.items()
            for index in range(len(addresses))
        )

    @property
    def num_workers(self) -> int:
        """Tasks that train together: the chief and the workers."""
        return len(self.jobs.get("chief", ())) + len(self.jobs.get("worker", ()))

    def address(self, task: Task) -> str:
        return self.jobs[task.type][task.index]

    def check_task(self, task: Task) -> Task:
        """Returns `task` if it is in the spec, else raises `ClusterSpecError`."""
        if task.type not in self.jobs:
            raise _invalid("task.type", self.source, task.type, f"a job of the cluster, one of {list(self.jobs)}")
        count = len(self.jobs[task.type])
        if not 0 <= task.index < count:
            raise _invalid(
                "task.index", self.source, task.index,
                f"an index from 0 to {count - 1} for job `{task.type}`",
            )
        return task

    def local_tasks(self) -> tuple[Task, ...]:
        """The tasks whose host is an address of this machine."""
        return tuple(
            task for task in self.tasks
            if is_local_host(split_address(self.address(task))[0])
        )

    def with_free_ports(self) -> "ClusterSpec":
        """Replaces every port 0 by a distinct free port of this host.

        Raises:
            ClusterSpecError: a port 0 on a host that is not this machine: the
                launchers of several hosts could not agree on it.
        """
        sockets: list[socket.socket] = []
        jobs = {}
        try:
            for job, addresses in self.jobs.items():
                resolved = []
                for index, address in enumerate(addresses):
                    host, port = split_address(address)
                    if port == 0:
                        if not is_local_host(host):
                            raise _invalid(
                                f"cluster.{job}[{index}]", self.source, address,
                                "a fixed port: port 0 only works for tasks on this "
                                "host, since the other hosts cannot know the port picked",
                            )
                        sock = socket.socket(
                            socket.AF_INET6 if ":" in host else socket.AF_INET
                        )
                        sockets.append(sock)
                        sock.bind((host, 0))
                        address = address[: -len("0")] + str(sock.getsockname()[1])
                    resolved.append(address)
                jobs[job] = tuple(resolved)
        finally:
            for sock in sockets:
                sock.close()
        return dataclasses.replace(self, jobs=jobs)

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": {job: list(addresses) for job, addresses in self.jobs.items()}}

    def tf_config(self, task: Task) -> str:
        """The `TF_CONFIG` JSON string of `task`."""
        self.check_task(task)
        for job, addresses in self.jobs.items():
            for index, address in enumerate(addresses):
                if split_address(address)[1] == 0:
                    raise _invalid(
                        f"cluster.{job}[{index}]", self.source, address,
                        "a real port: call `with_free_ports()` before `tf_config()`",
                    )
        return json.dumps(
            {**self.to_dict(), "task": {"type": task.type, "index": task.index}}
        )


def load_tf_config(environ: Mapping[str, str] | None = None) -> tuple[ClusterSpec, Task] | None:
    """Validates `TF_CONFIG` from `environ` (default `os.environ`).

    Returns:
        `(spec, task)`, or `None` when `TF_CONFIG` is unset or names no cluster.

    Raises:
        ClusterSpecError: `TF_CONFIG` is set but not usable.

    Example:

        >>> load_tf_config({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return None
    source = "TF_CONFIG"
    data = _parse_json(text, source)
    if isinstance(data, dict) and not data.get("cluster") and "task" not in data:
        return None
    spec = ClusterSpec.from_dict(data, source=source)
    task = data.get("task")
    if not isinstance(task, dict):
        raise _invalid("task", source, task, 'an object such as {"type": "worker", "index": 0}')
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type not in spec.jobs:
        raise _invalid("task.type", source, task_type, f"a job of the cluster, one of {list(spec.jobs)}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise _invalid("task.index", source, index, "an integer")
    return spec, spec.check_task(Task(task_type, index))


VERBOSE_ENV = "DISTRIB_TF_VERBOSE"  # "1": every worker prints its own lines (the launcher's --verbose sets it).


def speaks(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints distrib_tf's lines: the chief (`chief:0`, or `worker:0`
    in a cluster without one, or a process without `TF_CONFIG`), or any process with
    `DISTRIB_TF_VERBOSE=1`. The other workers speak when something happens to them (a
    warning, an error, a preemption), as Keras's one process does.

    Example:

        >>> speaks({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}'})
        False
    """
    environ = os.environ if environ is None else environ
    if environ.get(VERBOSE_ENV) == "1":
        return True
    try:
        found = load_tf_config(environ)
    except ClusterSpecError:
        return True
    if found is None:
        return True
    spec, task = found
    chief = ("chief", 0) if "chief" in spec.jobs else ("worker", 0)
    return (task.type, task.index) == chief
