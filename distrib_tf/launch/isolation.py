"""Isolating a job's tasks: a private network namespace, and death with the launcher.

This module imports no TensorFlow.
"""

import ctypes
import fcntl
import os
import re
import socket
import struct
import sys

from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import split_address

_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


def is_loopback_only(spec: ClusterSpec) -> bool:
    """Whether every address of `spec` is on this machine's loopback interface."""
    hosts = (split_address(spec.address(task))[0] for task in spec.tasks)
    return all(h in _LOOPBACK_HOSTS or h.startswith("127.") for h in hosts)


def enter_private_network() -> str | None:
    """Moves this process into a new network namespace that has only loopback.

    Tasks started afterwards share it: they reach each other on 127.0.0.1 and nothing
    outside can reach them (TensorFlow's gRPC servers listen on every interface).
    Unprivileged users get it through a user namespace where the kernel allows one.

    Returns:
        `None` on success, else why it could not be done.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(clone_newnet if uid == 0 else clone_newnet | clone_newuser) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:
        if uid != 0:  # Keep our own ids inside the user namespace.
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
                    f.write(text)
        siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
            fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
    except OSError as e:
        return f"loopback in the new namespace: {e}"
    return None


_TASK_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_task_init.py")


def dying_with_parent(command) -> list[str]:
    """`command`, started so that it and its children die with this process. Pure.

    See `distrib_tf/_task_init.py`: a parent-death signal, and a PID namespace where the
    kernel allows one.
    """
    return [sys.executable, _TASK_INIT, str(os.getpid()), *command]


def protect_network(spec: ClusterSpec, tasks, private: bool, say) -> bool:
    """Makes a loopback-only cluster private, or says loudly that the job is exposed.

    Returns whether the tasks run in a private namespace (and have no network access)."""
    exposed = ("TensorFlow's gRPC servers listen on every interface of this machine, with no "
               "authentication: whoever reaches them can join or disrupt the job (SECURITY.md)")
    if not is_loopback_only(spec) or set(tasks) != set(spec.tasks):
        # Other launchers run the other tasks: they must share this host's network.
        say(f"note: {exposed}; run it on a private network only")
    elif not private:
        say(f"WARNING: --network=host: {exposed}")
    elif (why := enter_private_network()) is not None:
        say(f"WARNING: could not make this local cluster private ({why}): {exposed}")
    else:
        say("local tasks run in a private network namespace: loopback only, "
            "unreachable from the network (and without network access: --network=host if they need it)")
        return True
    return False


# What a task prints when it tried to reach the network from the private namespace.
NO_NETWORK = re.compile(r"Network is unreachable|Temporary failure in name resolution|"
                        r"Name or service not known|No address associated with hostname|"
                        r"Could not resolve host|ENETUNREACH|EAI_AGAIN|getaddrinfo")


def no_network_hint(lines) -> str | None:
    """What to do when a task in the private namespace failed for want of a network."""
    if any(NO_NETWORK.search(line) for line in lines):
        return ("the tasks run in a private network namespace with no network access (loopback "
                "only); one that needs the network (gs:// data, a download) needs --network=host, "
                "which exposes TensorFlow's gRPC servers to this machine's network (SECURITY.md)")
    return None
