"""Kubernetes manifests and Slurm scripts: they parse, and every pod gets the launcher's TF_CONFIG."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from distrib_tf import exit_codes
from distrib_tf import launch
from distrib_tf.cluster import ClusterSpec

ROOT = os.path.dirname(os.path.dirname(__file__))
SPEC = os.path.join(ROOT, "cluster_specs", "local_chief_2workers.json")


def _export(*args):
    return subprocess.run([sys.executable, "-m", "distrib_tf.deploy", *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=30)


def test_kubernetes_manifests_parse_and_pods_get_the_launchers_tf_config(tmp_path):
    result = _export("kubernetes", f"--cluster_spec={SPEC}", "--image=registry.example/job:1",
                     "--name=mnist", "--", "python", "-m", "distrib_tf.train", "--epochs=5")
    assert result.returncode == 0, result.stderr
    config_map, service, job = list(yaml.safe_load_all(result.stdout))
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "mnist"
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(config_map["data"]["spec.json"])
    expected = ClusterSpec.from_dict({"cluster": {
        "chief": ["mnist-0.mnist:2222"], "worker": ["mnist-1.mnist:2222", "mnist-2.mnist:2222"]}})
    command = pod["containers"][0]["command"]
    assert command[0] == "distrib-tf-launch" and command[-4:] == ["python", "-m", "distrib_tf.train", "--epochs=5"]
    # The launcher stops its tasks within the pod's grace, not its own default of 10 s.
    assert pod["terminationGracePeriodSeconds"] == 120 and "--grace_period=110" in command
    for index, task in enumerate(expected.tasks):
        # What Kubernetes runs in pod `index`: $(JOB_COMPLETION_INDEX) expanded, the spec mounted.
        args = [a.replace("$(JOB_COMPLETION_INDEX)", str(index))
                 .replace("/etc/distrib_tf/spec.json", str(spec_file)) for a in command[1:]]
        config = launch.config_from_args(launch.parse_args(args))
        assert config.tasks == (task,)
        env = launch.task_env(config, config.spec.with_free_ports(), task, 0, {})
        assert json.loads(env["TF_CONFIG"]) == json.loads(expected.tf_config(task))


def test_slurm_script_and_cluster_from_slurm_variables():
    result = _export("slurm", f"--cluster_spec={SPEC}", "--", "python", "-m", "distrib_tf.train")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --ntasks=3" in result.stdout
    srun = "srun --wait=120 distrib-tf-launch --slurm --grace_period=110 -- python -m distrib_tf.train"
    assert srun in result.stdout
    assert "srun --kill-on-bad-exit" not in result.stdout  # It killed the rest at the first exit 75 (issue 33, 5).


def test_slurm_script_for_an_allocation_of_any_size_in_a_range():
    result = _export("slurm", "--nodes=1-4", "--tasks_per_node=2", "--", "python", "-m", "distrib_tf.train")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "#SBATCH --nodes=1-4" in lines and "#SBATCH --ntasks-per-node=2" in lines
    assert not any(line.startswith("#SBATCH --ntasks=") for line in lines)  # No fixed count: any size runs.
    sbatch = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert sbatch == list(range(1, len(sbatch) + 1))  # sbatch reads its options before the first other line.
    check = subprocess.run(["bash", "-n"], input=result.stdout, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("args, message", [
    (["--nodes=3-2"], "Invalid value for `--nodes`. Received: '3-2'. Expected N, or MIN-MAX"),
    (["--nodes=0"], "Invalid value for `--nodes`. Received: '0'."),
    (["--nodes=2", "--tasks_per_node=0"], "Invalid value for `--tasks_per_node`. Received: 0."),
    (["--nodes=2", f"--cluster_spec={SPEC}"], "received both `--cluster_spec` and `--nodes`"),
    ([], "received neither `--cluster_spec` nor `--nodes`"),
])
def test_slurm_size_mistakes_are_one_line(args, message):
    result = _export("slurm", *args, "--", "true")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_a_job_name_that_would_inject_script_lines_is_refused():
    result = _export("slurm", f"--cluster_spec={SPEC}", "--job_name=a\n#SBATCH --output=/etc/x", "--", "true")
    assert result.returncode == 2 and "Invalid value for `--job_name`" in result.stderr, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["kubernetes", f"--cluster_spec={SPEC}", "--", "true"], "the following arguments are required: --image"),
    (["kubernetes", f"--cluster_spec={SPEC}", "--image=x"], "Missing command."),
    (["kubernetes", f"--cluster_spec={SPEC}", "--image=x", "--port=0", "--", "true"],
     "Invalid value for `--port`. Received: 0."),
    (["slurm", "--cluster_spec=/nonexistent.json", "--", "true"], "Cannot read cluster spec /nonexistent.json"),
])
def test_bad_input(args, message):
    result = _export(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


@pytest.mark.parametrize("claim", [None, "training-runs"])
def test_kubernetes_manifests_validate_against_the_api_schema(claim):
    import kubernetes_validate  # pylint: disable=import-outside-toplevel

    args = ["kubernetes", f"--cluster_spec={SPEC}", "--image=registry.example/job:1", "--max_restarts=5"]
    result = _export(*args, *([f"--volume_claim={claim}"] if claim else []), "--",
                     "python", "-m", "distrib_tf.train", "--model_dir=/runs/cnn")
    assert result.returncode == 0, result.stderr
    assert ("no --volume_claim" in result.stderr) == (claim is None)
    documents = list(yaml.safe_load_all(result.stdout))
    for document in documents:
        kubernetes_validate.validate(document, "1.31", strict=True)
    job = documents[-1]["spec"]
    assert job["backoffLimit"] == 5 * 3  # 5 restarts of the job: a dead task fails its 2 peers too.
    rules = {rule["action"]: rule for rule in job["podFailurePolicy"]["rules"] if "onExitCodes" in rule}
    assert rules["Ignore"]["onExitCodes"]["values"] == [exit_codes.PREEMPTED]
    assert rules["FailJob"]["onExitCodes"]["values"] == [exit_codes.USAGE, exit_codes.PRUNED, exit_codes.NONFINITE]
    volumes = {v["name"]: v for v in job["template"]["spec"]["volumes"]}
    if claim:
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == claim
    else:
        assert "emptyDir" in volumes["runs"]


def test_slurm_script_asks_for_the_signal_and_requeues_on_preemption():
    result = _export("slurm", f"--cluster_spec={SPEC}", "--", "python", "-m", "distrib_tf.train")
    assert "#SBATCH --signal=TERM@120" in result.stdout and "#SBATCH --requeue" in result.stdout
    assert "distrib-tf-launch --slurm --grace_period=110 -- " in result.stdout  # Not its default 10 s.
    assert f'if [ "$code" -eq {exit_codes.PREEMPTED} ]; then scontrol requeue "$SLURM_JOB_ID"; fi' in result.stdout
    check = subprocess.run(["bash", "-n"], input=result.stdout, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


KUBE_EXAMPLE = ["--image=registry.example.com/distrib-tf:latest", "--name=distrib-tf-cnn",
                "--volume_claim=distrib-tf-runs"]


@pytest.mark.parametrize("engine, options, example", [
    ("kubernetes", KUBE_EXAMPLE, "kubernetes.yaml"),
    *[("kubernetes", [*KUBE_EXAMPLE, f"--engine={e}"], f"kubernetes-{e}.yaml")
      for e in ("jobset", "trainjob", "tfjob")],
    ("slurm", [], "train.sbatch"),
])
def test_the_examples_are_what_the_exporter_writes_today(engine, options, example):
    """`examples/` is regenerated by these commands: a change to an exporter must update it."""
    model_dir = "/runs/cnn" if engine == "kubernetes" else "runs/slurm"
    result = _export(engine, f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json", *options, "--",
                     "python", "-m", "distrib_tf.train", "--model=cnn", "--epochs=5", f"--model_dir={model_dir}",
                     "--backup_every_steps=100")
    assert result.returncode == 0, result.stderr
    with open(os.path.join(ROOT, "examples", example), encoding="utf-8") as f:
        assert result.stdout == f.read()


JOBSET_SCHEMA = os.path.join(ROOT, "tests", "schemas", "jobset-v0.12.0.json")  # Its "$comment": source.


def _jobset(*options):
    result = _export("kubernetes", "--engine=jobset", f"--cluster_spec={SPEC}", "--image=registry.example/job:1",
                     "--volume_claim=training-runs", *options, "--", "python", "-m", "distrib_tf.train",
                     "--model_dir=/runs/cnn")
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


def test_jobset_validates_against_its_crd_and_its_pods_get_jobset_hostnames():
    import jsonschema  # pylint: disable=import-outside-toplevel
    import kubernetes_validate  # pylint: disable=import-outside-toplevel

    config_map, jobset = _jobset("--max_restarts=4")
    with open(JOBSET_SCHEMA) as f:
        validator = jsonschema.Draft7Validator(json.load(f))
    validator.validate(jobset)  # The CRD's own schema, as the API server checks it.
    assert _pruned(validator.schema, jobset) == []
    broken = json.loads(json.dumps(jobset))
    broken["spec"]["failurePolicy"]["rules"][0]["action"] = "Restart"  # The check can fail.
    assert any("is not one of" in error.message for error in validator.iter_errors(broken))
    template = jobset["spec"]["replicatedJobs"][0]["template"]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
                                  "spec": template["spec"]}, "1.31", strict=True)
    kubernetes_validate.validate(config_map, "1.31", strict=True)
    spec = ClusterSpec.from_dict(json.loads(config_map["data"]["spec.json"]))
    assert [spec.address(task) for task in spec.tasks] == [
        f"distrib-tf-task-0-{i}.distrib-tf:2222" for i in range(3)]  # JobSet's DNS names.
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "distrib-tf"}
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 4


def _job_failure(job_spec, *, exit_code=None, condition=None):
    """Kubernetes's Job controller on one failed pod (pkg/controller/job/pod_failure_policy.go):
    the first podFailurePolicy rule that matches; no match counts against backoffLimit."""
    for index, rule in enumerate(job_spec["podFailurePolicy"]["rules"]):
        on_exit, on_conditions = rule.get("onExitCodes"), rule.get("onPodConditions", [])
        if on_exit and exit_code is not None and (exit_code in on_exit["values"]) == (on_exit["operator"] == "In"):
            message = (f"Container task for pod default/p-0 failed with exit code {exit_code} "
                       f"matching {rule['action']} rule at index {index}")
        elif any(c["type"] == condition for c in on_conditions):
            message = f"Pod default/p-0 has condition {condition} matching {rule['action']} rule at index {index}"
        else:
            continue
        assert rule["action"] == "FailJob", rule  # The JobSet export fails the Job: the set acts.
        return "PodFailurePolicy", message
    assert job_spec["backoffLimit"] == 0  # Counted, and no retry left: the Job fails.
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _jobset_action(jobset_spec, reason, message):
    """JobSet's controller (pkg/controllers/failure_policy.go, v0.12.0): the first rule whose
    reasons and message patterns (Go regexp, unanchored) match; else RestartJobSet."""
    for rule in jobset_spec["failurePolicy"]["rules"]:
        reasons, patterns = rule.get("onJobFailureReasons", []), rule.get("onJobFailureMessagePatterns", [])
        if (not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns)):
            return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize("failure, action", [
    ({"exit_code": 1}, "RestartJobSet"),  # A crash, or a survivor of a dead peer: restart all, counted.
    ({"exit_code": 137}, "RestartJobSet"),  # SIGKILL (OOM): the same.
    ({"exit_code": exit_codes.USAGE}, "FailJobSet"),  # Bad input: a retry fails again.
    ({"exit_code": exit_codes.PRUNED}, "FailJobSet"),  # Pruned by a sweep: not to be retried.
    ({"exit_code": exit_codes.NONFINITE}, "FailJobSet"),  # NaN stop: it would resume into it again.
    ({"exit_code": exit_codes.PREEMPTED}, "RestartJobSetAndIgnoreMaxRestarts"),  # State saved.
    ({"exit_code": 143, "condition": "DisruptionTarget"}, "RestartJobSetAndIgnoreMaxRestarts"),  # Evicted.
])
def test_jobset_restart_rules_do_what_each_exit_code_means(failure, action):
    _, jobset = _jobset()
    job_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    if "condition" in failure:  # Kubernetes matches rules in order: the exit code first.
        assert failure["exit_code"] not in {v for r in job_spec["podFailurePolicy"]["rules"]
                                           for v in r.get("onExitCodes", {}).get("values", [])}
    assert _jobset_action(jobset["spec"], *_job_failure(job_spec, **failure)) == action


def _schema(name):
    """A validator of the vendored CRD schema `name`, after checking that `pruned` finds
    nothing the API server would drop from what we write (its check is silent)."""
    import jsonschema  # pylint: disable=import-outside-toplevel

    with open(os.path.join(ROOT, "tests", "schemas", name)) as f:  # Each "$comment" gives its source.
        return jsonschema.Draft7Validator(json.load(f))


def _pruned(schema, value, path=""):
    """The fields of `value` that a structural schema does not know: the API server drops
    them without an error, so a misspelt field would vanish. (An object whose schema lists
    no fields, `metadata` for one, is checked by the API server itself.)"""
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _pruned(schema.get("items", {}), item, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    known = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    found = []
    for key, item in value.items():
        if key in known:
            found += _pruned(known[key], item, f"{path}.{key}")
        elif isinstance(extra, dict):
            found += _pruned(extra, item, f"{path}.{key}")
        elif known:
            found.append(f"{path}.{key}")
    return found


def _manifests(engine, *options):
    result = _export("kubernetes", f"--engine={engine}", f"--cluster_spec={SPEC}", "--image=registry.example/job:1",
                     "--volume_claim=training-runs", *options, "--", "python", "-m", "distrib_tf.train",
                     "--model_dir=/runs/cnn")
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


def test_trainjob_and_its_runtime_validate_against_their_crds_and_pods_get_jobset_hostnames():
    import kubernetes_validate  # pylint: disable=import-outside-toplevel

    config_map, runtime, trainjob = _manifests("trainjob", "--max_restarts=4")
    runtimes, trainjobs = _schema("trainingruntime-v2.3.0.json"), _schema("trainjob-v2.3.0.json")
    runtimes.validate(runtime)
    trainjobs.validate(trainjob)
    assert _pruned(runtimes.schema, runtime) == [] and _pruned(trainjobs.schema, trainjob) == []
    broken = json.loads(json.dumps(trainjob))
    del broken["spec"]["runtimeRef"]["name"]  # The checks can fail.
    assert any("'name' is a required property" in e.message for e in trainjobs.iter_errors(broken))
    broken["spec"]["trainer"]["numNodez"] = 3
    assert _pruned(trainjobs.schema, broken) == [".spec.trainer.numNodez"]
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                              "name": runtime["metadata"]["name"]}
    assert trainjob["spec"]["trainer"]["numNodes"] == runtime["spec"]["mlPolicy"]["numNodes"] == 3
    jobset = runtime["spec"]["template"]["spec"]
    _schema("jobset-v0.12.0.json").validate(  # The runtime's template is a JobSet's spec.
        {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "x"}, "spec": jobset})
    node = jobset["replicatedJobs"][0]
    assert node["name"] == "node" and node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}  # Trainer's trainer step.
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["name"] == "node"  # Trainer sets the command, env of this one.
    assert pod["containers"][0]["volumeMounts"][1]["subPathExpr"] == "task-$(JOB_COMPLETION_INDEX)"
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
                                  "spec": node["template"]["spec"]}, "1.31", strict=True)
    spec = ClusterSpec.from_dict(json.loads(config_map["data"]["spec.json"]))
    assert [spec.address(task) for task in spec.tasks] == [
        f"distrib-tf-node-0-{i}.distrib-tf:2222" for i in range(3)]  # The TrainJob's JobSet names.


def test_tfjob_validates_against_its_crd_and_asks_the_operator_for_tf_config():
    (tfjob,) = _manifests("tfjob")
    tfjobs = _schema("tfjob-v1.9.0.json")
    tfjobs.validate(tfjob)
    assert _pruned(tfjobs.schema, tfjob) == []
    broken = json.loads(json.dumps(tfjob))
    broken["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "2"  # The checks can fail.
    assert any("is not of type 'integer'" in e.message for e in tfjobs.iter_errors(broken))
    broken["spec"]["runPolicy"]["cleanPodPolicyy"] = "None"
    assert _pruned(tfjobs.schema, broken) == [".spec.runPolicy.cleanPodPolicyy"]
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Chief": 1, "Worker": 2}
    for replica in replicas.values():
        assert replica["restartPolicy"] == "ExitCode"
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "tensorflow"  # Whose exit code the operator reads.
        assert container["command"][:3] == ["distrib-tf-launch", "--tf_config", "--exit_codes=tfjob"]
        assert container["volumeMounts"] == [{"name": "runs", "mountPath": "/runs", "subPathExpr": "$(POD_NAME)"}]


def _is_retryable_exit_code(code):
    """The Training Operator's rule (v1.9.0 pkg/util/train/train_util.go, IsRetryableExitCode)."""
    return code >= 128


@pytest.mark.parametrize("code, retried", [
    (exit_codes.FAILED, True),  # A crash, or a survivor of a dead peer: its pod comes back.
    (exit_codes.PREEMPTED, True),  # State saved: it resumes.
    (exit_codes.USAGE, False),  # Bad input: the TFJob fails, a retry would fail again.
    (exit_codes.NONFINITE, False),  # NaN stop: the same.
])
def test_tfjob_launcher_exit_codes_meet_the_exit_code_policy(tmp_path, code, retried):
    """A pod's launcher for real, its task from TF_CONFIG as the operator writes it, its task
    exiting `code`: the code the pod ends with, under the operator's rule."""
    tf_config = {"cluster": {"chief": ["127.0.0.1:23480"], "worker": ["127.0.0.1:23481"]},
                 "task": {"type": "worker", "index": 0}}
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.launch", "--tf_config", "--exit_codes=tfjob", "--network=host",
         "--", sys.executable, "-c", f"import json, os, sys; print(os.environ['TF_CONFIG']); sys.exit({code})"],
        env={**os.environ, "PYTHONPATH": ROOT, "TF_CONFIG": json.dumps(tf_config)},
        capture_output=True, text=True, timeout=60)
    assert json.loads(re.search(r"\{.*\}", result.stdout).group(0))["task"] == tf_config["task"]
    assert (result.returncode != exit_codes.OK and _is_retryable_exit_code(result.returncode)) == retried, (
        result.returncode, result.stdout, result.stderr)
    without = subprocess.run(  # Our own codes, all under 128: every one would fail the TFJob.
        [sys.executable, "-m", "distrib_tf.launch", "--tf_config", "--network=host", "--",
         sys.executable, "-c", f"import sys; sys.exit({code})"],
        env={**os.environ, "PYTHONPATH": ROOT, "TF_CONFIG": json.dumps(tf_config)},
        capture_output=True, text=True, timeout=60)
    assert without.returncode == code and not _is_retryable_exit_code(without.returncode)


@pytest.mark.parametrize("engine", ["jobset", "trainjob", "tfjob"])
def test_an_evaluator_that_would_never_see_a_checkpoint_is_refused(engine):
    """Issue 33 item 3: each task mounts its own sub-path of the claim, so the evaluator's
    checkpoints/ stayed empty and it exited 1 after an hour, restarting or failing the job."""
    result = _export("kubernetes", f"--engine={engine}", f"--cluster_spec={ROOT}/cluster_specs/local_evaluator.json",
                     "--image=registry.example/job:1", "--volume_claim=training-runs", "--", "python", "-m",
                     "distrib_tf.train")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Received: an evaluator task" in errors[0], result.stderr


def test_ray_num_workers_is_a_count_or_an_elastic_range():
    from distrib_tf.deploy import ray_train  # pylint: disable=import-outside-toplevel  (no Ray needed)

    assert ray_train.parse_num_workers("2") == 2 and ray_train.parse_num_workers("1:4") == (1, 4)
    for bad in ("0", "3:2", "a", "1:", ":2", "-1"):
        with pytest.raises(ValueError, match="Expected N, or MIN:MAX"):
            ray_train.parse_num_workers(bad)
