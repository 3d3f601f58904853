"""The fork server: a forked task is its command as a new interpreter would run it.

The server here pre-imports `json` only (no TensorFlow), so these tests take seconds."""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from distrib_tf.launch import forkserver
from distrib_tf.launch import supervise


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An environment naming a running server of this interpreter."""
    path = str(tmp_path_factory.mktemp("fork") / "socket")
    env = {k: v for k, v in os.environ.items() if k != forkserver.FORKSERVER_ENV}
    server = subprocess.Popen([sys.executable, "-m", "distrib_tf.launch.forkserver", path, "json"], env=env)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield {**env, forkserver.FORKSERVER_ENV: path}
    server.terminate()
    assert server.wait(timeout=10) == 0


def _run(env, code, *args, **kwargs):
    command = [sys.executable, "-c", code, *args]
    assert forkserver.serves(command, env)
    return forkserver.spawn(command, env=env, stdout=-1, stderr=-2, text=True, **kwargs)


def test_a_forked_task_has_the_callers_arguments_environment_directory_and_session(served, tmp_path):
    env = {**served, "ASKED": "yes"}
    task = _run(env, "import json, os, sys; print(json.dumps([sys.argv, os.environ.get('ASKED'), os.getcwd(), "
                     "os.getpgid(0) == os.getpid(), os.getppid()]))", "a", "b", cwd=str(tmp_path))
    output, _ = task.communicate(timeout=30)
    argv, asked, cwd, own_session, parent = json.loads(output)
    assert task.returncode == 0 and argv == ["-c", "a", "b"] and asked == "yes" and cwd == str(tmp_path)
    assert own_session and parent != os.getpid()  # Its parent is the server.


def test_a_forked_task_ends_as_python_ends_exit_codes_hooks_and_signals(served):
    task = _run(served, "import atexit, sys; atexit.register(print, 'atexit ran'); sys.exit(3)")
    assert task.communicate(timeout=30)[0] == "atexit ran\n" and task.returncode == 3
    task = _run(served, "raise ValueError('told')")
    output, _ = task.communicate(timeout=30)
    assert task.returncode == 1 and output.splitlines()[-1] == "ValueError: told"  # sys.excepthook's traceback.
    task = _run(served, "import threading, time; threading.Thread(target=lambda: (time.sleep(0.5), "
                        "print('joined', flush=True))).start()")
    assert task.communicate(timeout=30)[0] == "joined\n" and task.returncode == 0  # Non-daemon threads joined.
    task = _run(served, "import time; print('up', flush=True); time.sleep(60)")
    assert task.stdout.readline() == "up\n"
    os.killpg(task.pid, signal.SIGTERM)  # As the launcher signals a task's group.
    task.communicate(timeout=30)
    assert task.returncode == -signal.SIGTERM


def test_a_pythonpath_of_other_modules_comes_first_on_the_path(served, tmp_path):
    (tmp_path / "mine.py").write_text("WHERE = 'here'\n")
    env = {**served, "PYTHONPATH": str(tmp_path)}
    task = _run(env, "import sys, mine; print(mine.WHERE, sys.path[1])")
    assert task.communicate(timeout=30)[0] == f"here {tmp_path}\n" and task.returncode == 0


def test_a_passed_descriptor_keeps_its_number(served):
    read_end, write_end = os.pipe()
    task = _run(served, f"import os; os.write({write_end}, b'event')", pass_fds=(write_end,))
    os.close(write_end)
    task.communicate(timeout=30)
    assert task.returncode == 0 and os.read(read_end, 100) == b"event"
    os.close(read_end)


def test_a_forked_task_dies_with_its_caller(served, tmp_path):
    """A caller SIGKILLed (a launcher killed) takes its task along, as `_task_init` does."""
    caller = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from distrib_tf.launch import forkserver\n"
        "task = forkserver.spawn([sys.executable, '-c', 'import time; time.sleep(120)'], env=dict(os.environ))\n"
        "print(task.pid, flush=True)\n"
        "time.sleep(120)\n")], env=served, stdout=subprocess.PIPE, text=True)
    pid = int(caller.stdout.readline())
    os.kill(pid, 0)  # Running.
    caller.kill()
    caller.wait()
    caller.stdout.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"task {pid} outlived its caller")


def test_what_a_fork_cannot_be_starts_as_a_new_process(served):
    assert not forkserver.serves(["/bin/echo", "hi"], served)  # Another program.
    assert not forkserver.serves([sys.executable, "-X", "dev", "-c", "pass"], served)  # Other interpreter flags.
    stdlib = os.path.dirname(os.path.dirname(json.__file__))  # Holds `json`, which the server imported.
    assert not forkserver.serves([sys.executable, "-c", "pass"], {**served, "PYTHONPATH": stdlib})
    assert not forkserver.serves([sys.executable, "-c", "pass"], {**served, forkserver.FORKSERVER_ENV: ""})
    assert forkserver.serves([sys.executable, "-u", "-m", "json.tool"], served)
    assert not forkserver.serves([sys.executable, "-c", "pass"], {**served, "TF_CPP_MIN_LOG_LEVEL": "3"})  # At import.
    several = f"/nonexistent/socket:{served[forkserver.FORKSERVER_ENV]}"  # The first that answers and serves.
    assert forkserver.serves([sys.executable, "-c", "pass"], {**served, forkserver.FORKSERVER_ENV: several})


_IN_A_POD = """
import json, os, sys
from distrib_tf.launch import forkserver
command = [sys.executable, "-c", "import json, os, socket; print(json.dumps([socket.gethostbyname('peer-of-the-pod'), "
           "socket.gethostname(), [os.readlink(f'/proc/self/ns/{n}') for n in ('net', 'uts', 'mnt')]]))"]
assert forkserver.serves(command, dict(os.environ))
task = forkserver.spawn(command, env=dict(os.environ), stdout=-1, stderr=-2, text=True)
output = task.communicate(timeout=30)[0]
ours = [os.readlink(f"/proc/self/ns/{n}") for n in ("net", "uts", "mnt")]
address, name, theirs = json.loads(output.splitlines()[-1]) if task.returncode == 0 else (output, None, None)
print(json.dumps([address, name, theirs == ours, task.returncode]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_caller_in_namespaces_of_its_own_gets_a_task_in_them(served, tmp_path):
    # As `ip netns exec` starts a pod's launcher: a network of its own and a hosts file mounted
    # over /etc/hosts (in a mount namespace); a host name of its own here too.
    (tmp_path / "hosts").write_text("10.9.8.7 peer-of-the-pod\n")
    (tmp_path / "caller.py").write_text(_IN_A_POD)
    script = (f"mount --bind {tmp_path / 'hosts'} /etc/hosts && hostname pod-of-its-own && "
              f"exec {sys.executable} {tmp_path / 'caller.py'}")
    out = subprocess.run(["unshare", "--net", "--uts", "--mount", "sh", "-c", script], env=served,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["10.9.8.7", "pod-of-its-own", True, 0]


def _own_server(tmp_path, name="own"):
    """A server of this test's alone (it is killed), with the environment naming it."""
    path = str(tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != forkserver.FORKSERVER_ENV}
    server = subprocess.Popen([sys.executable, "-m", "distrib_tf.launch.forkserver", path, "json"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # Answering (a socket left at the path is no server).
        try:
            forkserver._connect(path).close()  # pylint: disable=protected-access
            break
        except OSError:
            time.sleep(0.05)
    return server, {**env, forkserver.FORKSERVER_ENV: path}


def _gone(pid, seconds=30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_task_dies_with_its_server(tmp_path):
    """A server SIGKILLed takes its tasks along: its callers see them killed (-9), and a
    launcher that restarts them finds no copy of them still running."""
    server, env = _own_server(tmp_path)
    task = forkserver.spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"], env=env,
                            stdout=-1, stderr=-2, text=True)
    assert task.stdout.readline() == "up\n"
    task.stdout.close()
    server.kill()
    server.wait()
    try:
        assert task.wait(timeout=30) == -signal.SIGKILL and _gone(task.pid), f"task {task.pid} outlived its server"
    finally:
        if not _gone(task.pid, 0):
            os.kill(task.pid, signal.SIGKILL)


def test_a_caller_gone_before_its_answer_leaves_the_server_serving(tmp_path):
    """A launcher killed between its request and the answer: its task goes, the server and
    the other callers' tasks stay (the server died of the broken pipe, orphaning them all)."""
    server, env = _own_server(tmp_path)
    try:
        other = forkserver.spawn([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
        namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in forkserver.NAMESPACES]
        request = {"args": ["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
                   "env": env, "cwd": os.getcwd(), "pass_fds": []}
        read_end, write_end = os.pipe()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(env[forkserver.FORKSERVER_ENV])
            socket.send_fds(sock, [json.dumps(request).encode()], [0, write_end, 2, *namespaces])
        for fd in (write_end, *namespaces):
            os.close(fd)
        told, deadline = b"", time.monotonic() + 30
        while select.select([read_end], [], [], max(deadline - time.monotonic(), 0))[0]:
            if not (chunk := os.read(read_end, 100)):
                break  # Its stdout closed: the task is gone (killed before it printed, or after).
            told += chunk
        else:
            pytest.fail(f"the task of a caller gone ({told!r}) outlived it")
        os.close(read_end)
        assert server.poll() is None and other.poll() is None
        task = _run(env, "print('served')")
        assert task.communicate(timeout=30)[0] == "served\n" and task.returncode == 0
        other.kill()
        assert other.wait(timeout=30) == -signal.SIGKILL
    finally:
        server.kill()
        server.wait()


def test_a_server_gone_inside_a_request_makes_the_launcher_start_a_new_process(tmp_path):
    """A server that answered `describe` and dies on the fork request: an OSError, for the
    launcher to start the task as a new process (it raised a JSONDecodeError)."""
    server, env = _own_server(tmp_path, "real")
    described = forkserver._Server(env[forkserver.FORKSERVER_ENV]).described  # pylint: disable=protected-access
    server.kill()
    server.wait()
    path = str(tmp_path / "dying")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)

    def dying():
        for _ in range(2):
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
            for fd in fds:
                os.close(fd)
            if json.loads(message).get("describe"):
                conn.send(json.dumps(described).encode())
            conn.close()  # The fork request: no answer.

    thread = threading.Thread(target=dying, daemon=True)
    thread.start()
    read_end, write_end = os.pipe()
    command = [sys.executable, "-c", f"import os; os.write({write_end}, b'ran')"]
    try:
        proc = supervise._start(command, env={**env, forkserver.FORKSERVER_ENV: path},  # pylint: disable=protected-access
                                events_fd=write_end)
        os.close(write_end)
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0 and os.read(read_end, 10) == b"ran"
        proc.stdout.close()
    finally:
        os.close(read_end)
        listener.close()


def test_a_stopped_server_is_one_gone_and_a_killed_ones_socket_is_taken_over(tmp_path, monkeypatch):
    """A server that does not answer (SIGSTOP) is passed over within the answer's bound (the
    launcher waited for it forever); a server killed leaves its socket, which the next one at
    that path takes over; a path where a server answers is refused in one line, exit 2."""
    server, env = _own_server(tmp_path)
    command = [sys.executable, "-c", "pass"]
    try:
        os.kill(server.pid, signal.SIGSTOP)
        monkeypatch.setattr(forkserver, "_ANSWER_SECONDS", 1.0)
        monkeypatch.setattr(forkserver, "_servers", {})
        started = time.monotonic()
        assert not forkserver.serves(command, env) and time.monotonic() - started < 10
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        assert os.path.exists(env[forkserver.FORKSERVER_ENV])  # Left behind.
        monkeypatch.setattr(forkserver, "_servers", {})
        server, env = _own_server(tmp_path)  # At the same path.
        assert _run(env, "print('served')").communicate(timeout=30)[0] == "served\n"
        again = subprocess.run([sys.executable, "-m", "distrib_tf.launch.forkserver", env[forkserver.FORKSERVER_ENV],
                                "json"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and again.stderr == (
            f"distrib-tf-forkserver: error: A fork server already listens at {env[forkserver.FORKSERVER_ENV]}. "
            "Expected a path no other server uses.\n")
    finally:
        server.kill()
        server.wait()


def test_a_path_that_is_a_file_is_refused_and_kept(tmp_path):
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    done = subprocess.run([sys.executable, "-m", "distrib_tf.launch.forkserver", str(kept), "json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and kept.read_text() == "mine", done.stderr
    assert done.stderr == (f"distrib-tf-forkserver: error: Cannot listen at {kept}. Received: a file that is not "
                           "a socket. Expected a path a Unix socket can be made at.\n")
