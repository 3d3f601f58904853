"""Simulated hosts: network namespaces joined by a veth pair (root and iproute2 only)."""

import contextlib
import os
import shutil
import subprocess
import sys

SUBNET = "10.199.77"


def available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    return None


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts():
    """Yields `[(namespace, address), (namespace, address)]`; deletes them afterwards."""
    tag = os.getpid() % 100000
    hosts = [(f"dtf{tag}a", f"{SUBNET}.1"), (f"dtf{tag}b", f"{SUBNET}.2")]
    veth = [f"vdtf{tag}a", f"vdtf{tag}b"]
    try:
        for name, _ in hosts:
            _ip("netns", "add", name)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for (name, address), end in zip(hosts, veth):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", end)
            _ip("-n", name, "link", "set", end, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name, _ in hosts:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def set_link(hosts, up: bool):
    """Brings the veth end of the second host down or up: a cut cable."""
    name = hosts[1][0]
    links = subprocess.run(["ip", "-n", name, "-o", "link"], capture_output=True, text=True).stdout
    end = next(line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if "vdtf" in line)
    _ip("-n", name, "link", "set", end, "up" if up else "down")


@contextlib.contextmanager
def outside_host():
    """A namespace joined to this one by a veth pair: `(namespace, our_address, its_address)`."""
    tag = os.getpid() % 100000
    name, ours, theirs = f"dtf{tag}o", f"vdtf{tag}h", f"vdtf{tag}o"
    host_address, outside_address = "10.199.78.1", "10.199.78.2"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        _ip("link", "set", theirs, "netns", name)
        _ip("addr", "add", f"{host_address}/24", "dev", ours)
        _ip("link", "set", ours, "up")
        _ip("-n", name, "addr", "add", f"{outside_address}/24", "dev", theirs)
        _ip("-n", name, "link", "set", theirs, "up")
        yield name, host_address, outside_address
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", ours], capture_output=True)


def can_connect(namespace: str, address: str, port: int) -> bool:
    """Whether a TCP connection from `namespace` to `address:port` opens (2 s at most)."""
    code = (f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()")
    return subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", code],
                          capture_output=True, timeout=30).returncode == 0
