"""The first process of every task: it dies with the launcher and takes the task along.

Run by `distrib_tf.launch.supervise` as `python _task_init.py LAUNCHER_PID COMMAND...` (a file,
not a module of the package: it imports nothing of distrib_tf). It

1. asks Linux to SIGKILL it when the launcher dies (`PR_SET_PDEATHSIG`), and gives up if
   the launcher is already gone;
2. where the kernel allows (root), opens a new PID namespace whose first process (a
   copy of this one, PID 1) dies with this one and runs COMMAND as PID 2: when PID 1
   dies the kernel kills everything left in the namespace, so a killed launcher leaves
   no grandchild behind either (`bash -c 'sleep 300 & ...'`). Both forward SIGTERM,
   SIGINT, SIGHUP and SIGUSR1/2 down to COMMAND, which handles signals as usual (not
   as a PID 1), and this process ends as COMMAND ended: its exit code (129 to 159 too), or
   killed by the same signal (SIGKILL included): PID 1 hands it COMMAND's wait status
   through a pipe, since a PID 1 cannot die of a signal it sends itself;
3. where namespaces are refused, simply becomes COMMAND (`exec`): the launcher's death
   still kills the task, not its own children;
4. binds itself, before any of that, to the CPUs listed in `DISTRIB_TF_CPUS` ("0,1"),
   when set (`distrib_tf.launch.placement` shares them out).

This replaces a `preexec_fn`, which the Python documentation warns can deadlock in a
process with threads (the launcher has its output pumps). Inside the namespace COMMAND
sees itself as PID 2 (`os.getpid()`), whichever task it is.
"""

import ctypes
import os
import signal
import sys

_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _supervise(pid: int, *, reap_all: bool) -> int:
    """Forwards signals to `pid` until it ends; returns how it ended as an exit code."""
    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        ended, status = os.waitpid(-1 if reap_all else pid, 0)  # PID 1 reaps orphans too.
        if ended == pid:
            return status


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(sys.argv[1]):
        os._exit(137)  # The launcher died before we could ask to die with it.
    command = sys.argv[2:]
    cpus = os.environ.get("DISTRIB_TF_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if libc.unshare(_CLONE_NEWPID) != 0:
        os.execvp(command[0], command)
    status_read, status_write = os.pipe()  # PID 1 tells how COMMAND ended: it cannot die of a signal itself.
    init = os.fork()  # The first child after unshare is PID 1 of the new namespace.
    if init == 0:
        os.close(status_read)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # Dies with us; the kernel empties the namespace.
        task = os.fork()
        if task == 0:
            os.close(status_write)
            os.execvp(command[0], command)  # PID 2: ordinary signal handling.
        status = _supervise(task, reap_all=True)
        os.write(status_write, str(status).encode())
        os._exit(0)
    os.close(status_write)
    _supervise(init, reap_all=False)
    with os.fdopen(status_read, "rb") as f:
        told = f.read()
    _end_as(int(told) if told else None)


def _end_as(status: int | None):
    """Ends this process as COMMAND ended: its exit code (any, 129 to 159 too), or killed by
    its signal (SIGKILL and SIGSTOP cannot be given a handler, nor need one). `None`: PID 1
    itself was killed before it could tell (by the kernel, as the launcher died): 137."""
    if status is None:
        os._exit(137)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)

if __name__ == "__main__":
    main()
