"""Tasks forked from a pre-imported interpreter: TensorFlow's start-up paid once, not per task.

Importing Keras and TensorFlow takes a Python process about 10 s of one core here; a test
suite or a job restarted many times pays it for every task it starts. A fork server pays it
once: it imports the modules named (Keras, hence TensorFlow, by default) and waits on a Unix
socket; each request is answered by a fork, which becomes the command asked for:

    python -m distrib_tf.launch.forkserver /tmp/fork.sock &     # Once.
    DISTRIB_TF_FORKSERVER=/tmp/fork.sock distrib-tf-launch --cluster_spec=... -- python my_script.py

(`DISTRIB_TF_FORKSERVER` may name several servers, `:`-separated: the first that can run a
command runs it, e.g. one per TensorFlow log level.)

Contract (`spawn`): the command must be `PYTHON [-u] (-m MODULE | SCRIPT | -c CODE) ARGS...`
with the server's own interpreter (the same path, so the same venv), and an environment
that agrees with the server's on what is read at import (`IMPORT_TIME_ENV`, every other
`PYTHON*` variable; a `PYTHONPATH` only where it holds no module the server imported);
anything else is started as usual (`serves` says which). The child gets
the caller's arguments, environment, working directory, standard streams, the file
descriptors passed (at their numbers), the caller's network, mount and UTS namespaces (a
pod's, as `ip netns exec` makes them: its own `/etc/hosts`) and CPUs (`DISTRIB_TF_CPUS`), a
session of its own, and Python's usual end (non-daemon threads joined, `atexit`,
`sys.excepthook`, exit codes, death by signal). It dies with the caller (the server SIGKILLs
the child's process group when the caller's connection closes) and with the server (a
parent-death signal). What differs from a fresh interpreter: the child's parent is the server,
and `ps` shows the server's command line; Python's hash seed is the server's; what the imports print
is printed once, by the server; and NumPy's global random state is the server's (seed it).

This module imports no TensorFlow itself (the server imports what it is told to, by name).
"""

import json
import os
import selectors
import shutil
import signal
import socket
import stat
import sys
import time

from distrib_tf import exit_codes
from distrib_tf.launch import _forked

FORKSERVER_ENV = "DISTRIB_TF_FORKSERVER"  # The sockets of servers that `spawn` may use, `:`-separated.
# Read while the server imported its modules: a request must agree with the server on them.
# (TensorFlow's C++ log level too: it is read at the first line logged, at import.)
IMPORT_TIME_ENV = ("KERAS_BACKEND", "KERAS_HOME", "TF_USE_LEGACY_KERAS", "TF_ENABLE_ONEDNN_OPTS", "LD_PRELOAD",
                   "LD_LIBRARY_PATH", "MPLBACKEND", "MPLCONFIGDIR", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL")
_NOT_AT_IMPORT = ("PYTHONUNBUFFERED", "PYTHONPATH")  # The PYTHON* variables a child applies itself.
_MAX_FDS = 16
_ANSWER_SECONDS = 30.0  # A server answers a description or a fork in milliseconds; past this, it is gone.
NAMESPACES = tuple(_forked.NAMESPACE_FLAGS)  # A child's caller's, their descriptors after the others.


def _namespaces() -> dict:
    return {name: os.stat(f"/proc/self/ns/{name}").st_ino for name in NAMESPACES}


# The client: the launcher's side (and a test's).

def _import_env(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if k in IMPORT_TIME_ENV or (k.startswith("PYTHON") and k not in _NOT_AT_IMPORT)}


def _shadows(env: dict, described: dict) -> bool:
    """Whether a folder of `env`'s `PYTHONPATH` holds a module the server imported (the child
    would import another copy of it): else the child takes that `PYTHONPATH` on its `sys.path`."""
    imported = set(described["top_level"])
    for folder in _forked.path_entries(env) - _forked.path_entries(described):
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:  # A module, an extension, or a package (a folder without one is no package).
            module, _, suffix = name.partition(".")
            if module in imported and (suffix in ("py", "pyc") or suffix.endswith("so") or os.path.exists(
                    os.path.join(folder, name, "__init__.py"))):
                return True
    return False


def _python_args(args) -> list | None:
    """`args` after the interpreter, if a fork can run them (`-u` and one of -m/-c/a script)."""
    args = list(args)
    while args and args[0] == "-u":
        args = args[1:]
    if not args or (args[0].startswith("-") and args[0] not in ("-m", "-c")) or (args[0] in ("-m", "-c")
                                                                                and len(args) < 2):
        return None
    return args


class _Server:
    """What a running server told about itself."""

    def __init__(self, path: str):
        self.path = path
        with _connect(path) as sock:
            sock.sendmsg([json.dumps({"describe": True}).encode()])
            self.described = json.loads(sock.recv(1 << 20))

    def serves(self, command, env: dict) -> bool:
        program = shutil.which(command[0], path=env.get("PATH")) if command else None
        return (program is not None and os.path.abspath(program) == self.described["executable"]
                and _python_args(command[1:]) is not None and _import_env(env) == self.described["import_env"]
                and not _shadows(env, self.described)
                and (os.geteuid() == 0 or _namespaces() == self.described["namespaces"]))  # setns needs root.


_servers: dict[str, _Server | None] = {}


def _answering(path: str) -> "_Server | None":
    if path not in _servers:
        try:
            _servers[path] = _Server(path)
        except OSError:
            _servers[path] = None  # Gone: tasks start as usual.
    return _servers[path]


def server(command, env: dict) -> "_Server | None":
    """The first server `env` names that answers and can run `command` in `env`."""
    for path in filter(None, env.get(FORKSERVER_ENV, "").split(":")):
        if (found := _answering(path)) is not None and found.serves(command, env):
            return found
    return None


def serves(command, env: dict) -> bool:
    """Whether `spawn(command, env=env)` would fork (else it is started as usual)."""
    return server(command, env) is not None


def _connect(path: str) -> socket.socket:
    """A connection whose answers take `_ANSWER_SECONDS` at most (a stopped server is one gone)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)  # Blocking: a full backlog waits (a timeout would fail it at once, EAGAIN).
        sock.settimeout(_ANSWER_SECONDS)
    except OSError:
        sock.close()
        raise
    return sock


class Forked:
    """A forked task, as much of `subprocess.Popen` as the launcher and the tests use."""

    def __init__(self, sock: socket.socket, pid: int, stdout):
        self._sock, self.pid, self.stdout, self.returncode = sock, pid, stdout, None
        self._read: list[bytes] = []  # What `communicate` read before a timeout.

    def _status(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._sock.settimeout(timeout)
        try:
            told = self._sock.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        status = json.loads(told)["status"] if told else None
        if status is None:  # The server died: its children with it.
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = os.waitstatus_to_exitcode(status)
        self._sock.close()

    def poll(self) -> int | None:
        self._status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess  # pylint: disable=import-outside-toplevel

        self._status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(["forked", str(self.pid)], timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        """The task's whole output (its stdout, where it was a pipe) once it ended."""
        import subprocess  # pylint: disable=import-outside-toplevel

        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = self._read
        if self.stdout is not None and not self.stdout.closed:
            selector = selectors.DefaultSelector()
            selector.register(self.stdout, selectors.EVENT_READ)
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 or not selector.select(left):
                    raise subprocess.TimeoutExpired(["forked", str(self.pid)], timeout, b"".join(chunks))
                chunk = os.read(self.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            selector.close()
            self.stdout.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        output = b"".join(chunks)
        if self.stdout is not None and "b" not in self.stdout.mode:
            output = output.decode(self.stdout.encoding, "replace")
        return output, None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # The server reaps an ended task at once: its pid may be another's.
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(command, *, env: dict, cwd: str | None = None, stdin: int | None = None, stdout: int | None = None,
          stderr: int | None = None, pass_fds=(), text: bool = False) -> Forked:
    """Starts `command` as a fork of the server `env` names (`serves` must be true).

    `stdin`, `stdout`, `stderr`: file descriptors for the child (default: this process's);
    `stdout=-1` makes a pipe whose read end is `Forked.stdout` (binary, or text with
    `text=True`); `stderr=-2` is stdout's."""
    found = server(command, env)
    read_end = None
    if stdout == -1:
        read_end, stdout = os.pipe()
    stderr = stdout if stderr == -2 else stderr
    streams = [0 if stdin is None else stdin, 1 if stdout is None else stdout, 2 if stderr is None else stderr]
    namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in NAMESPACES]
    fds = [*streams, *pass_fds, *namespaces]
    request = {"args": _python_args(command[1:]), "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd()),
               "pass_fds": list(pass_fds)}
    sock = None
    try:
        sock = _connect(found.path)
        socket.send_fds(sock, [json.dumps(request).encode()], fds)
        told = sock.recv(4096)
        if not told:  # The server died inside the request.
            raise ConnectionError(f"the fork server at {found.path} closed the connection without an answer")
        answer = json.loads(told)
        if "error" in answer:
            raise OSError(answer["error"])
    except BaseException:
        if sock is not None:
            sock.close()
        if read_end is not None:
            os.close(read_end)
        raise
    finally:
        for fd in namespaces:
            os.close(fd)
        if read_end is not None:
            os.close(stdout)
    stream = None if read_end is None else (os.fdopen(read_end, "r" if text else "rb"))
    return Forked(sock, answer["pid"], stream)


# The server.

def serve(path: str, modules=("keras",)) -> None:
    """Imports `modules`, then forks a child for each request on the socket at `path`,
    until SIGTERM or SIGINT; every child is SIGKILLed with its group as its caller leaves."""
    _clear(path)
    for name in modules:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    described = {"executable": os.path.abspath(sys.executable), "import_env": _import_env(dict(os.environ)),
                 "modules": list(modules), "pid": os.getpid(), "namespaces": _namespaces(),
                 "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                 "top_level": sorted({name.split(".")[0] for name in sys.modules} - {"__main__", "distrib_tf"})}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket | None] = {}  # A child's pid: its caller's connection.
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    while not stop:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ)
                continue
            conn = key.fileobj
            pid = next((p for p, c in children.items() if c is conn), None)
            if pid is None:
                pid = _answer(conn, described, selector, listener)
                if pid is not None:
                    children[pid] = conn
                    continue
            selector.unregister(conn)  # Described, refused, or the caller gone (its child too).
            conn.close()
            if pid is not None:
                children[pid] = None  # Reaped later, told to nobody.
                _kill_group(pid)
        _reap(children, selector)
    for pid in list(children):
        _kill_group(pid)
    listener.close()
    os.unlink(path)


def _answer(conn, described, selector, listener) -> int | None:
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, _MAX_FDS)
    except OSError:
        return None
    if not message:
        return None
    request = json.loads(message)
    if request.get("describe"):
        _send(conn, described)
        return None
    settled, settling = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(settled)
        _forked.become(request, fds, own=[selector.fileno(), *(k.fd for k in selector.get_map().values())],
                       server=described["pid"], settling=settling)
    os.close(settling)
    for fd in fds:
        os.close(fd)
    # The pid goes out once the child leads a session of its own with SIGTERM's default meaning:
    # a caller's killpg before that found no group (or ran this server's handler), and the
    # SIGTERM was lost. (EOF: the child died first; its caller learns that from its exit.)
    os.read(settled, 1)
    os.close(settled)
    _send(conn, {"pid": pid})  # A caller gone already: its closed connection kills the child next.
    return pid


def _send(conn, message: dict) -> None:
    """`message` to a caller, unless it left (a server that raised would orphan every task)."""
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass


def _reap(children, selector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.send(json.dumps({"status": status}).encode())
            except OSError:
                pass
            selector.unregister(conn)
            conn.close()


def _kill_group(pid: int) -> None:
    """The child's group, and the child itself (it may not have made its group yet)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _clear(path: str) -> None:
    """Removes a socket left by a server gone; a server still answering there is an error."""
    try:
        _connect(path).close()
    except ConnectionRefusedError:
        if not stat.S_ISSOCK(os.stat(path).st_mode):  # A file of another kind: not ours to remove.
            _usage_error(f"Cannot listen at {path}. Received: a file that is not a socket. Expected a path a "
                         "Unix socket can be made at.")
        os.unlink(path)  # Left by a server that was killed.
        return
    except FileNotFoundError:
        return
    except OSError as e:
        _usage_error(f"Cannot listen at {path}. Received: {e.strerror}. Expected a path a Unix socket can be made at.")
    _usage_error(f"A fork server already listens at {path}. Expected a path no other server uses.")


def _usage_error(message: str) -> None:
    print(f"distrib-tf-forkserver: error: {message}", file=sys.stderr)
    sys.exit(exit_codes.USAGE)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m distrib_tf.launch.forkserver SOCKET [MODULE...]", file=sys.stderr)
        sys.exit(2)
    serve(argv[0], tuple(argv[1:]) or ("keras",))


if __name__ == "__main__":
    main()
