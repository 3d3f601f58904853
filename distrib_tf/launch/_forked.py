"""The fork's side of `distrib_tf.launch.forkserver`: a child of the server becomes the command.

It takes the caller's streams, descriptors, network namespace, environment, `sys.path` and
directory, runs the command as `python` would (`-m`, `-c` or a script), then ends as Python
ends: non-daemon threads joined, `atexit`, `sys.excepthook`, exit codes, death by signal.
This module imports no TensorFlow.
"""

import atexit
import ctypes
import os
import signal
import sys
import threading
import traceback

# The namespaces a child joins, each with its setns(2) flag; their descriptors come last, in this order.
NAMESPACE_FLAGS = {"net": 0x40000000, "uts": 0x04000000, "mnt": 0x00020000}
_PR_SET_PDEATHSIG = 1


def path_entries(env) -> set:
    """The folders of `env`'s `PYTHONPATH`."""
    return set(filter(None, env.get("PYTHONPATH", "").split(os.pathsep)))


def _purge_own() -> None:
    """distrib_tf as the caller has it (its PYTHONPATH, its edits): imported afresh."""
    for name in [m for m in sys.modules if m == "distrib_tf" or m.startswith("distrib_tf.")]:
        del sys.modules[name]


def become(request: dict, fds: list, own: list, server: int, settling: int) -> None:
    """In the fork of the process `server`: the caller's streams, descriptors, namespace,
    environment and directory, then the command, then Python's own end. Never returns.
    Writes to `settling` once it leads a session of its own with the signals' own meanings
    (the server hands out its pid then: a signal to it from then on is its own)."""
    code = 1
    try:
        os.setsid()
        _die_with(server)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.write(settling, b"1")
        os.close(settling)
        given = fds[:-len(NAMESPACE_FLAGS)]
        _join(dict(zip(NAMESPACE_FLAGS, fds[-len(NAMESPACE_FLAGS):])))
        targets = [0, 1, 2, *request["pass_fds"]]
        high = [os.dup(fd) for fd in given]  # Above every target first: they may overlap.
        for fd in {*fds, *own}:
            if fd not in high:
                os.close(fd)
        for fd, target in zip(high, targets):
            os.dup2(fd, target)
        for fd in high:
            if fd not in targets:
                os.close(fd)
        env = request["env"]
        ours, theirs = path_entries(os.environ), [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
        sys.path[1:] = [*theirs, *(e for e in sys.path[1:] if e not in ours)]  # As Python puts PYTHONPATH.
        os.environ.clear()
        os.environ.update(env)
        if cpus := env.get("DISTRIB_TF_CPUS"):
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        os.chdir(request["cwd"])
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False, encoding="utf-8")  # pylint: disable=consider-using-with
        sys.stdout = open(1, "w", closefd=False, encoding="utf-8", errors="backslashreplace",  # pylint: disable=consider-using-with
                          buffering=1 if unbuffered else -1)
        sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="backslashreplace", buffering=1)  # pylint: disable=consider-using-with
        _purge_own()
        _run(request["args"])
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # pylint: disable=broad-except  (as Python's own top level)
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # pylint: disable=broad-except
            traceback.print_exc()
        code = 1
    os._exit(_end(code))


def _die_with(server: int) -> None:
    """SIGKILLed as the server ends, however it ends (its SIGKILL too): its callers are told
    their tasks died, and a launcher that starts them again finds no copy still running."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != server:  # It ended before the prctl.
        os._exit(1)


def _join(namespaces: dict) -> None:
    """The caller's namespaces, where they are not the server's (the fork is single-threaded,
    as joining a mount namespace needs; that resets the directory, set after)."""
    for name, fd in namespaces.items():
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino and \
                ctypes.CDLL(None, use_errno=True).setns(fd, NAMESPACE_FLAGS[name]) != 0:
            raise OSError(ctypes.get_errno(), f"setns: the caller's {name} namespace")


def _run(args: list) -> None:
    import runpy  # pylint: disable=import-outside-toplevel

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end(code: int) -> int:
    """Python's end: non-daemon threads joined, `atexit` run, streams flushed."""
    try:
        threading._shutdown()  # pylint: disable=protected-access
    except BaseException:  # pylint: disable=broad-except
        pass
    try:
        atexit._run_exitfuncs()  # pylint: disable=protected-access
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
    _flush()
    return code


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
