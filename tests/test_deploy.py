"""deploy/: every pod of each JobSet manifest, built as Kubernetes would, derives one cluster.

Kubernetes cannot run here. What can be checked is what towerflow reads: each
pod's environment (the downward-API values of its JobSet labels, the
completion index its Indexed Job adds, its DNS hostname), the command it
runs, and the `TF_CONFIG` `--cluster=jobset` derives from them, for every
pod of every replicated job. Every pod must see the same cluster, name a
different member, and find each member at the DNS name of the pod that runs it.
The tf.data service's JobSet likewise: each pod's role, port, dispatcher and
the host name trainers reach it at, from `python -m trainer.data_service`'s
own derivation.
"""

import dataclasses
import pathlib
import re

import pytest
import yaml
from absl import flags

from strategies.cluster import discovery
from strategies.cluster import tf_config as cluster
from towerflow.errors import MEMBER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE
from trainer import cli, data_service

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = {
    "jobset-multi-worker.yaml": "multi_worker",
    "jobset-parameter-server.yaml": "parameter_server",
}
_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


@dataclasses.dataclass
class Pod:
    """One pod of a JobSet, as Kubernetes would run it."""

    replicated_job: str
    hostname: str
    environ: dict[str, str]
    command: list[str]
    spec: dict


def _jobset(name: str) -> dict:
    (jobset,) = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    return jobset


def _pods(jobset: dict) -> list[Pod]:
    """Every pod: each replicated job x its replicas x its completion indices."""
    name, pods = jobset["metadata"]["name"], []
    for replicated in jobset["spec"]["replicatedJobs"]:
        replicas = replicated.get("replicas", 1)
        job = replicated["template"]["spec"]
        for job_index in range(replicas):
            for index in range(job["completions"]):
                labels = {  # what the JobSet controller puts on each pod
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                    "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicas),
                    "jobset.sigs.k8s.io/job-index": str(job_index),
                }
                annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
                hostname = f"{name}-{replicated['name']}-{job_index}-{index}"
                (container,) = job["template"]["spec"]["containers"]
                environ = {"HOSTNAME": hostname, "JOB_COMPLETION_INDEX": str(index)}
                for variable in container["env"]:
                    environ[variable["name"]] = _value(variable, labels, annotations)
                command = container["command"] + container.get("args", [])
                pods.append(Pod(replicated["name"], hostname, environ, command, job))
    return pods


def _value(variable: dict, labels: dict, annotations: dict) -> str:
    """A container variable's value: given, or from the pod's metadata (the downward API)."""
    if "value" in variable:
        return str(variable["value"])
    path = variable["valueFrom"]["fieldRef"]["fieldPath"]
    if path == "status.podIP":  # known once the pod runs
        return "<the pod's IP>"
    match = _FIELD.fullmatch(path)
    assert match, f"{variable['name']}: a field this test cannot resolve: {path}"
    kind, key = match.groups()
    return (labels if kind == "labels" else annotations)[key]


def _tf_config(pod: Pod) -> cluster.ClusterSpec:
    """What `python -m trainer` derives in `pod`: its own flags parsed, then discovery."""
    assert pod.command[:3] == ["python", "-m", "trainer"], pod.command
    argv = ["towerflow", *pod.command[3:]]
    defined = cli.define_flags(flags.FlagValues(), argv)
    cli.parse_flags(defined, argv)
    config = defined.config.value
    cli.set_cluster_source(config, defined.cluster.value)
    found = discovery.find(config.cluster, defined.strategy.value, pod.environ)
    assert found.source == "jobset"
    return cluster.parse(found.tf_config)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_derives_the_same_cluster_and_its_own_member(name):
    jobset = _jobset(name)
    pods = _pods(jobset)
    specs = [_tf_config(pod) for pod in pods]
    jobs = specs[0].addresses
    assert all(spec.addresses == jobs for spec in specs), "one cluster on every pod"
    members = [(spec.task_type, spec.task_index) for spec in specs]
    every_member = [
        (job, index) for job, addresses in jobs.items() for index in range(len(addresses))
    ]
    assert sorted(members) == sorted(every_member), "each member exactly once"
    counts = {
        r["name"]: r.get("replicas", 1) * r["template"]["spec"]["completions"]
        for r in jobset["spec"]["replicatedJobs"]
    }
    assert {job: len(addresses) for job, addresses in jobs.items()} == counts
    subdomain = jobset["spec"].get("network", {}).get("subdomain", jobset["metadata"]["name"])
    for pod, spec in zip(pods, specs):
        assert spec.task_type == pod.replicated_job
        port = pod.spec["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert (
            spec.addresses[spec.task_type][spec.task_index] == f"{pod.hostname}.{subdomain}:{port}"
        )


def test_the_topologies_fit_their_strategies():
    multi_worker = _tf_config(_pods(_jobset("jobset-multi-worker.yaml"))[0])
    assert list(multi_worker.addresses) == ["worker"] and multi_worker.is_chief
    parameter_server = _tf_config(_pods(_jobset("jobset-parameter-server.yaml"))[0])
    assert parameter_server.has_chief and parameter_server.num_ps and parameter_server.num_workers
    assert "evaluator" in parameter_server.addresses, "listed, so the chief leaves evaluation to it"


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_same_command_on_every_pod_with_a_shared_model_dir(name):
    jobset = _jobset(name)
    pods = _pods(jobset)
    assert len({tuple(pod.command) for pod in pods}) == 1, "the same command on every member"
    assert f"--strategy={MANIFESTS[name]}" in pods[0].command
    (claim,) = [d for d in yaml.safe_load_all((DEPLOY / "volume.yaml").read_text()) if d]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    for pod in pods:
        pod_spec = pod.spec["template"]["spec"]
        (volume,) = pod_spec["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        (mount,) = pod_spec["containers"][0]["volumeMounts"]
        assert mount["name"] == volume["name"]
        model_dir = next(a for a in pod.command if a.startswith("--model_dir="))
        assert model_dir.removeprefix("--model_dir=").startswith(mount["mountPath"] + "/")


@pytest.mark.parametrize("name", MANIFESTS)
def test_only_preemption_and_a_lost_member_restart_the_jobset(name):
    jobset = _jobset(name)
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    (rule,) = policy["rules"]  # and by default: restart
    assert (rule["action"], rule["onJobFailureReasons"]) == ("FailJobSet", ["PodFailurePolicy"])
    retried = sorted([PREEMPTED_EXIT_CODE, MEMBER_LOST_EXIT_CODE])
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = replicated["template"]["spec"]
        assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
        disrupted, other_codes = job["podFailurePolicy"]["rules"]
        assert disrupted["action"] == "Count"
        assert disrupted["onPodConditions"][0]["type"] == "DisruptionTarget"
        assert other_codes["action"] == "FailJob"
        assert other_codes["onExitCodes"]["operator"] == "NotIn"
        assert sorted(other_codes["onExitCodes"]["values"]) == retried
        container = job["template"]["spec"]["containers"][0]["name"]
        assert other_codes["onExitCodes"]["containerName"] == container


# --- deploy/jobset-data-service.yaml: python -m trainer.data_service --cluster=jobset -------

DATA_SERVICE = "jobset-data-service.yaml"


def _server(pod: Pod) -> data_service.Server:
    """What `python -m trainer.data_service` serves in `pod`: its flags, then discovery."""
    assert pod.command[:3] == ["python", "-m", "trainer.data_service"], pod.command
    given = dict(arg.removeprefix("--").split("=", 1) for arg in pod.command[3:])
    assert set(given) <= set(data_service.flags.FLAGS), given  # flags the command defines
    return data_service.server(
        given.get("cluster", "auto"),
        given.get("role"),
        int(given["port"]) if "port" in given else None,
        given.get("dispatcher"),
        given.get("work_dir", ""),
        given.get("host"),
        pod.environ,
    )


def test_each_data_service_pod_derives_its_role_port_and_dispatcher():
    jobset = _jobset(DATA_SERVICE)
    name = jobset["metadata"]["name"]
    pods = _pods(jobset)
    servers = [_server(pod) for pod in pods]
    assert [pod.replicated_job for pod in pods] == ["dispatcher", "data-worker", "data-worker"]
    (dispatcher,) = [s for s in servers if s.kind == "dispatcher"]
    dispatcher_pod = pods[servers.index(dispatcher)]
    address = f"{dispatcher_pod.hostname}.{name}:{dispatcher.port}"
    assert address == f"{name}-dispatcher-0-0.{name}:5050"
    for pod, server in zip(pods, servers):
        container = pod.spec["template"]["spec"]["containers"][0]
        assert server.port == container["ports"][0]["containerPort"]
        if server.kind == "worker":
            assert server.host == f"{pod.hostname}.{name}", "trainers reach it by its DNS name"
            assert server.dispatcher == address
    # The address trainers are told to use (manifest, deploy/README.md, docs/data-service.md).
    trainer_flag = f"--config.data.service=grpc://{address}"
    for text in (
        (DEPLOY / DATA_SERVICE).read_text(),
        (DEPLOY / "README.md").read_text(),
        (DEPLOY.parent / "docs" / "data-service.md").read_text(),
    ):
        assert trainer_flag in text


def test_the_dispatcher_journals_on_the_shared_volume():
    pods = _pods(_jobset(DATA_SERVICE))
    (claim,) = [d for d in yaml.safe_load_all((DEPLOY / "volume.yaml").read_text()) if d]
    (pod,) = [p for p in pods if p.replicated_job == "dispatcher"]
    pod_spec = pod.spec["template"]["spec"]
    (volume,) = pod_spec["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = pod_spec["containers"][0]["volumeMounts"]
    assert mount["name"] == volume["name"]
    assert _server(pod).work_dir.startswith(mount["mountPath"] + "/")
    for pod in pods:  # a crashed server restarts in place, at its DNS name
        assert pod.spec["template"]["spec"]["restartPolicy"] == "OnFailure"
        assert pod.spec["backoffLimit"] >= 1


def test_the_elastic_jobset_runs_an_agent_per_pod_and_recreates_only_a_lost_one():
    import trainer.elastic  # noqa: F401  (defines the agent's own flags)
    from trainer.launch import parse_workers

    jobset = _jobset("jobset-elastic.yaml")
    assert "failurePolicy" not in jobset["spec"], "a lost member must not restart every pod"
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure" and job["backoffLimit"] > 0
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "trainer.elastic"]
    split = command.index("--")
    own = dict(arg.removeprefix("--").split("=", 1) for arg in command[3:split])
    assert all(name in flags.FLAGS for name in own), own  # the agent's flags, as it defines them
    low, high, _ = parse_workers(own["workers"])
    assert 1 <= low <= high == job["completions"] == job["parallelism"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert own["address"] == "$(POD_IP)"  # Kubernetes expands it from the variable below
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    argv = ["towerflow", *command[split + 1 :]]
    defined = cli.define_flags(flags.FlagValues(), argv)
    cli.parse_flags(defined, argv)
    assert defined.strategy.value == "multi_worker"
    (mount,) = container["volumeMounts"]
    assert defined.model_dir.value.startswith(mount["mountPath"] + "/")  # the rendezvous
    claim = {v["name"]: v for v in pod["volumes"]}[mount["name"]]["persistentVolumeClaim"]
    assert claim["claimName"] == "towerflow-runs"  # deploy/volume.yaml's, ReadWriteMany
    hostnames = [p.hostname for p in _pods(jobset)]  # each agent's default name: its pod's
    assert len(set(hostnames)) == len(hostnames) == high
