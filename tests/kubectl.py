"""A `kubectl` for the sweep's Kubernetes engine: the Jobs it creates run as pods here.

No API server runs here. This answers the commands the sweep gives
(`distrib_tf.experiments.sweep_kubernetes`), keeping the API's objects as files under
`$DISTRIB_TF_KUBE_API` and playing each Job over real pods (`kube_pods.JobEngine` and
`kube_pods.Cluster`: a network namespace per pod, from `$DISTRIB_TF_KUBE_HOSTS`; the
Job's `podFailurePolicy` and `backoffLimit` decide each exit):

    kubectl create -f FILE         the ConfigMap, Service and Job (AlreadyExists for a name
                                   taken); a controller process starts the Job's pods and
                                   writes its status
    kubectl get job.batch NAME --ignore-not-found -o json
                                   {"metadata": ..., "status": {"conditions": [...]}}, as the
                                   Job controller writes them; nothing once deleted
    kubectl get persistentvolumeclaim/NAME -o name
                                   found if NAME is in `$DISTRIB_TF_KUBE_CLAIMS`
    kubectl logs -l batch.kubernetes.io/job-name=NAME --prefix ...
                                   every pod's output, each line prefixed with its pod
    kubectl delete job.batch/NAME [--cascade=foreground] [--wait=false] [--ignore-not-found]
                                   every pod SIGTERM, SIGKILL after the grace period; with
                                   `foreground` the Job is found until its pods are gone
                                   (a Service or ConfigMap named is not kept here: ignored)

Each controller writes `controller.log` beside its Job's file: what the Job did to each pod
(the test's record).
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kube_pods import Cluster  # noqa: E402  pylint: disable=wrong-import-position
from kube_pods import JobEngine  # noqa: E402  pylint: disable=wrong-import-position

API_ENV = "DISTRIB_TF_KUBE_API"  # A directory: a Job's objects and status in API/NAME/.
HOSTS_ENV = "DISTRIB_TF_KUBE_HOSTS"  # JSON: [[namespace, address], ...], one per pod.
CLAIMS_ENV = "DISTRIB_TF_KUBE_CLAIMS"  # The claims that exist, by name, comma-separated.


class Deleted(Exception):
    """The Job was deleted while its pods ran."""


def _dir(name: str) -> str:
    return os.path.join(os.environ[API_ENV], name)


def _write(path: str, value) -> None:
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(f"{path}.tmp", path)


def create(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        manifests = {d["kind"]: d for d in yaml.safe_load_all(f)}
    name = manifests["Job"]["metadata"]["name"]
    if os.path.exists(_dir(name)):
        print(f'Error from server (AlreadyExists): error when creating "{path}": jobs.batch "{name}" already exists',
              file=sys.stderr)
        return 1
    os.makedirs(_dir(name), exist_ok=True)
    _write(os.path.join(_dir(name), "status.json"), {"active": manifests["Job"]["spec"]["completions"]})
    _write(os.path.join(_dir(name), "job.json"), manifests)
    with open(os.path.join(_dir(name), "controller.log"), "a", encoding="utf-8") as log:
        controller = subprocess.Popen([sys.executable, __file__, "--control", name], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
    with open(os.path.join(_dir(name), "controller.pid"), "w", encoding="utf-8") as f:
        f.write(str(controller.pid))
    print(f"configmap/{name} created\nservice/{name} created\njob.batch/{name} created")
    return 0


def claim(name: str) -> int:
    if name not in os.environ.get(CLAIMS_ENV, "").split(","):
        print(f'Error from server (NotFound): persistentvolumeclaims "{name}" not found', file=sys.stderr)
        return 1
    print(f"persistentvolumeclaim/{name}")
    return 0


def get(name: str) -> int:
    """`--ignore-not-found`: nothing at all once the Job is gone."""
    try:
        with open(os.path.join(_dir(name), "job.json"), encoding="utf-8") as f:
            job = json.load(f)["Job"]
        with open(os.path.join(_dir(name), "status.json"), encoding="utf-8") as f:
            status = json.load(f)
    except FileNotFoundError:
        return 0
    metadata = dict(job["metadata"])
    if os.path.exists(os.path.join(_dir(name), "deleting")):
        metadata["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps({"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job["spec"],
                      "status": status}))
    return 0


def logs(selector: str) -> int:
    """Every pod's output of the Job `batch.kubernetes.io/job-name=NAME`, each line prefixed
    with its pod and container as `--prefix` does."""
    name = selector.removeprefix("batch.kubernetes.io/job-name=")
    pod_suffix = "x7k2p"  # A pod's name: its Job's, its index, and five random characters.
    for path in sorted(glob.glob(os.path.join(_dir(name), "pod*.log"))):
        index = os.path.basename(path)[len("pod"):-len(".log")]
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                sys.stdout.write(f"[pod/{name}-{index}-{pod_suffix}/task] {line}")
    return 0


def delete(objects: list[str], options: list[str]) -> int:
    names = {o.split("/", 1)[1] for o in objects if o.startswith("job.batch/")}
    for name in names:
        if not os.path.exists(os.path.join(_dir(name), "job.json")):
            if "--ignore-not-found" not in options:
                print(f'Error from server (NotFound): jobs.batch "{name}" not found', file=sys.stderr)
                return 1
            continue
        with open(os.path.join(_dir(name), "deleting"), "w", encoding="utf-8") as f:
            f.write("foreground" if "--cascade=foreground" in options else "background")
        if "--cascade=foreground" not in options:  # The Job goes at once, its pods after it.
            os.remove(os.path.join(_dir(name), "job.json"))
        if "--wait=false" not in options:
            while os.path.exists(os.path.join(_dir(name), "job.json")):
                time.sleep(0.2)
        print(f"job.batch \"{name}\" deleted")
    return 0


def control(name: str) -> None:
    """Plays the Job: its pods until it completes, fails, or is deleted."""
    with open(os.path.join(_dir(name), "job.json"), encoding="utf-8") as f:
        manifests = json.load(f)
    engine = JobEngine(_dir(name), manifests=manifests)
    cluster = Cluster(json.loads(os.environ[HOSTS_ENV]), engine)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # The test's cleanup: the pods too.

    def deleted(_):
        if os.path.exists(os.path.join(_dir(name), "deleting")):
            cluster.delete_all()
            raise Deleted
        return False

    try:
        outcome = cluster.run(3600, hook=deleted)
    except Deleted:
        print(f"deleted: {engine.log}", flush=True)
        for kept in ("job.json", "status.json"):
            if os.path.exists(os.path.join(_dir(name), kept)):
                os.remove(os.path.join(_dir(name), kept))
        return
    finally:
        cluster.close()
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if outcome == "Succeeded":
        conditions = [{"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": now},
                      {"type": "Complete", "status": "True", "lastTransitionTime": now}]
    else:
        reason, message = engine.failure
        conditions = [{"type": "FailureTarget", "status": "True", "reason": reason, "message": message},
                      {"type": "Failed", "status": "True", "reason": reason, "message": message,
                       "lastTransitionTime": now}]
    print(f"{outcome}: {engine.log}", flush=True)
    _write(os.path.join(_dir(name), "status.json"), {"conditions": conditions})


def main(argv: list[str]) -> int:
    if argv[:1] == ["--control"]:
        control(argv[1])
        return 0
    if argv[:2] == ["create", "-f"]:
        return create(argv[2])
    if argv[:2] == ["get", "job.batch"] and argv[3:] == ["--ignore-not-found", "-o", "json"]:
        return get(argv[2])
    if argv[:1] == ["get"] and argv[1].startswith("persistentvolumeclaim/") and argv[2:] == ["-o", "name"]:
        return claim(argv[1].split("/", 1)[1])
    if argv[:2] == ["logs", "-l"]:
        return logs(argv[2])
    if argv[:1] == ["delete"]:
        return delete([a for a in argv[1:] if not a.startswith("-")], [a for a in argv[1:] if a.startswith("-")])
    print(f"error: this kubectl plays `create -f`, `get job.batch|persistentvolumeclaim`, `logs -l`, `delete`; "
          f"got {argv}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
