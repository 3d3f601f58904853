"""A PostgreSQL server of a test's own: Debian's `postgresql` (`initdb`, `pg_ctl`), on a free
port in a scratch directory, as the `postgres` user when run as root; optionally inside a
network namespace (a simulated node), listening on that node's address.

`server()` yields the URL (user postgres, no password), or raises `Unavailable` with the
reason (the callers skip, or fail where DISTRIB_TF_REQUIRE_POSTGRES=1).
"""

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile


class Unavailable(RuntimeError):
    """No PostgreSQL server can start here (the message says why)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(*, listen: str = "127.0.0.1", netns: str | None = None, clients: str | None = None):
    """A running server listening on `listen` (inside the network namespace `netns`, if given),
    trusting `clients` (a CIDR such as `10.81.0.0/24`) besides the host itself. Stopped at the end."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise Unavailable("PostgreSQL is not installed (apt-get install -y postgresql)")
    try:
        import psycopg  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
        raise Unavailable("psycopg is not installed (pip install -e '.[test]')") from e
    binaries = os.path.dirname(found[-1])
    scratch = tempfile.mkdtemp(prefix="distrib_tf_postgres_")
    as_user = []
    if os.geteuid() == 0:  # initdb refuses root: the server runs as the postgres user.
        try:
            user = pwd.getpwnam("postgres")
        except KeyError as e:
            shutil.rmtree(scratch)
            raise Unavailable("running as root without a postgres user to run the server as") from e
        os.chown(scratch, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port, data = free_port(), os.path.join(scratch, "data")
    ctl = [*as_user, os.path.join(binaries, "pg_ctl"), "-D", data]
    inside = ["nsenter", f"--net=/run/netns/{netns}"] if netns else []
    try:
        subprocess.run([*as_user, os.path.join(binaries, "initdb"), "-D", data, "-A", "trust", "-U", "postgres"],
                       check=True, capture_output=True, timeout=120)
        if clients:
            with open(os.path.join(data, "pg_hba.conf"), "a", encoding="utf-8") as f:
                f.write(f"host all all {clients} trust\n")
        subprocess.run([*inside, *ctl, "-o", f"-p {port} -k {scratch} -c listen_addresses={listen} -c fsync=off",
                        "-l", os.path.join(scratch, "server.log"), "-w", "start"], check=True, capture_output=True,
                       timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(scratch, ignore_errors=True)
        raise Unavailable(f"PostgreSQL did not start: {e} {getattr(e, 'stderr', b'')!r}") from e
    try:
        yield f"postgresql+psycopg://postgres@{listen}:{port}/postgres"
    finally:
        subprocess.run([*ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=120)
        shutil.rmtree(scratch, ignore_errors=True)
