"""NodeAgent: the one stand-in of the test cluster — a kubelet that runs pods as local processes.

There is no scheduler and no container runtime here. The agent registers a Node, binds pending
pods to it, and for each bound pod starts its first container's command (image ignored) as a
process on a loopback address of its own (127.0.0.x, all routed to `lo` on Linux), with the
container's env (plain values and fieldRefs) and `$(VAR)` expansion in command and args. It
reports pod status through the API like a kubelet (phase, podIP, container state, Ready from
the readiness probe), restarts a container whose process exits (restartPolicy Always), and on
graceful deletion runs the preStop exec hook, sends SIGTERM, waits the grace period, kills, and
removes the pod. Executables are looked up on PATH with this Python environment's bin first, so
a pod whose command is `kvscale-worker serve ...` runs the worker of this checkout.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

logger = logging.getLogger("kvscale.e2e.node")
NODE_NAME = "kvscale-node-0"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known variables are replaced, unknown ones left as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class PodProcess:
    namespace: str
    name: str
    uid: str
    ip: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False
    started_at: str = field(default_factory=_now)
    stopping: bool = False
    last_exit: int | None = None
    ready_changed_at: str = field(default_factory=_now)  # the Ready condition's lastTransitionTime


class NodeAgent:
    def __init__(self, kubeconfig: Path | str, log_dir: Path, label_selector: str | None = None) -> None:
        api_client = config.new_client_from_config(str(kubeconfig))
        self.api = client.CoreV1Api(api_client)
        self.log_dir = Path(log_dir)
        self._server = api_client.configuration.host
        self._ca_file = self.log_dir / "ca.crt"
        self.label_selector = label_selector
        self.pods: dict[str, PodProcess] = {}  # by pod uid
        self._free_ips = [f"127.0.0.{i}" for i in range(2, 255)]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        bin_dir = str(Path(sys.executable).parent)
        self.path = bin_dir + os.pathsep + os.environ.get("PATH", "")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._ca_file.write_bytes(Path(self.api.api_client.configuration.ssl_ca_cert).read_bytes())
        self._register_node()
        for target in (self._watch_pods, self._probe_loop):
            t = threading.Thread(target=target, daemon=True, name=f"node-{target.__name__}")
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            pods = list(self.pods.values())
        for p in pods:
            self._terminate(p, grace=5)
        for t in self._threads:
            t.join(timeout=10)

    def _register_node(self) -> None:
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "250", "ephemeral-storage": "100Gi"}
        node = client.V1Node(
            metadata=client.V1ObjectMeta(name=NODE_NAME, labels={"kubernetes.io/hostname": NODE_NAME}),
            status=client.V1NodeStatus(
                capacity=capacity,
                allocatable=capacity,
                addresses=[client.V1NodeAddress(type="InternalIP", address="127.0.0.1")],
                conditions=[
                    client.V1NodeCondition(
                        type="Ready",
                        status="True",
                        reason="KvscaleNodeAgent",
                        message="stand-in node (e2e/node.py)",
                    )
                ],
            ),
        )
        try:
            self.api.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
        self.api.patch_node_status(NODE_NAME, {"status": node.status.to_dict()})

    # -- pods ----------------------------------------------------------------------------------
    def _watch_pods(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.api.list_pod_for_all_namespaces(label_selector=self.label_selector)
                for pod in pods.items:
                    self._reconcile(pod)
                w = watch.Watch()
                for event in w.stream(
                    self.api.list_pod_for_all_namespaces,
                    label_selector=self.label_selector,
                    resource_version=pods.metadata.resource_version,
                    timeout_seconds=30,
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    pod = event["object"]
                    if event["type"] == "DELETED":
                        self._forget(pod.metadata.uid)
                    else:
                        self._reconcile(pod)
            except Exception:  # the API server restarting, a watch expiring: list again
                if not self._stop.is_set():
                    logger.exception("pod watch failed; relisting")
                    time.sleep(1)

    def _reconcile(self, pod) -> None:
        meta, spec = pod.metadata, pod.spec
        if not spec.node_name:
            if meta.deletion_timestamp is None:
                self._bind(pod)
            return
        if spec.node_name != NODE_NAME:
            return
        if meta.deletion_timestamp is not None:
            threading.Thread(target=self._delete, args=(pod,), daemon=True).start()
            return
        with self._lock:
            known = meta.uid in self.pods
        if not known and pod.status.phase not in ("Succeeded", "Failed"):
            self._run(pod)

    def _bind(self, pod) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=pod.metadata.name),
            target=client.V1ObjectReference(kind="Node", name=NODE_NAME),
        )
        try:  # _preload_content=False: the generated client cannot parse Binding's Status reply
            self.api.create_namespaced_pod_binding(
                pod.metadata.name, pod.metadata.namespace, body, _preload_content=False
            )
        except ApiException as e:
            if e.status not in (404, 409):  # deleted meanwhile, or bound already
                raise

    def _env(self, pod, container, ip: str) -> dict[str, str]:
        # KVSCALE_HOST: processes share this host's network, so a kvscale worker is told to listen
        # on its pod's address (in a real pod it listens on all addresses of its own namespace).
        env = {
            "PATH": self.path,
            "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHONUNBUFFERED": "1",
            "KVSCALE_HOST": ip,
        }
        if pod.spec.automount_service_account_token is not False:
            env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod))
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LANG"):
            if key in os.environ:
                env[key] = os.environ[key]
        fields = {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": pod.metadata.namespace,
            "metadata.uid": pod.metadata.uid,
            "spec.nodeName": NODE_NAME,
            "spec.serviceAccountName": pod.spec.service_account_name or "default",
            "status.podIP": ip,
            "status.hostIP": "127.0.0.1",
        }
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = expand(var.value, env)
            elif var.value_from is not None and var.value_from.field_ref is not None:
                env[var.name] = fields.get(var.value_from.field_ref.field_path, "")
            elif var.value_from is not None and var.value_from.secret_key_ref is not None:
                ref = var.value_from.secret_key_ref
                secret = self.api.read_namespaced_secret(ref.name, pod.metadata.namespace)
                env[var.name] = base64.b64decode((secret.data or {}).get(ref.key, "")).decode()
        return env

    def _service_account_kubeconfig(self, pod) -> Path:
        """The pod's service-account credentials, as a kubelet would project them, but handed over
        as a kubeconfig (a process here cannot see /var/run/secrets of its own)."""
        sa = pod.spec.service_account_name or "default"
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=24 * 3600)
        )
        token = self.api.create_namespaced_service_account_token(
            sa, pod.metadata.namespace, request
        ).status.token
        path = self.log_dir / f"{pod.metadata.namespace}_{pod.metadata.name}.kubeconfig"
        ns = pod.metadata.namespace
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "c",
                    "cluster": {"server": self._server, "certificate-authority": str(self._ca_file)},
                }
            ],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa, "namespace": ns}}],
            "current-context": "c",
        }
        path.write_text(json.dumps(kubeconfig))  # JSON is YAML
        return path

    def _run(self, pod) -> None:
        with self._lock:
            if not self._free_ips:
                raise RuntimeError("no loopback address left")
            p = PodProcess(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, self._free_ips.pop(0))
            self.pods[p.uid] = p
        self._spawn(pod, p)

    def _spawn(self, pod, p: PodProcess) -> None:
        container = pod.spec.containers[0]
        env = self._env(pod, container, p.ip)
        argv = [expand(a, env) for a in (container.command or []) + (container.args or [])]
        if not container.command:
            self._set_status(
                pod, p, waiting="NoCommand", message="the stand-in node runs commands, not images"
            )
            return
        exe = shutil.which(argv[0], path=env["PATH"]) or argv[0]
        log = (self.log_dir / f"{p.namespace}_{p.name}.log").open("ab")
        try:
            p.proc = subprocess.Popen(
                [exe, *argv[1:]], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd()
            )
        except OSError as e:
            self._set_status(pod, p, waiting="RunContainerError", message=str(e))
            return
        p.started_at, p.ready = _now(), False
        p.ready_changed_at = p.started_at
        logger.info("started %s/%s on %s: %s", p.namespace, p.name, p.ip, " ".join(argv))
        self._set_status(pod, p)

    def _set_status(self, pod, p: PodProcess, waiting: str | None = None, message: str = "") -> None:
        container = pod.spec.containers[0]
        running = p.proc is not None and p.proc.poll() is None
        if waiting:
            state = {"waiting": {"reason": waiting, "message": message}}
        elif running:
            state = {"running": {"startedAt": p.started_at}}
        else:
            state = {"terminated": {"exitCode": p.last_exit or 0, "reason": "Error", "finishedAt": _now()}}
        ready = "True" if p.ready and running else "False"
        status = {
            "phase": "Running" if running else "Pending",
            "hostIP": "127.0.0.1",
            "podIP": p.ip,
            "podIPs": [{"ip": p.ip}],
            "startTime": p.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": p.ready_changed_at},
                {"type": "Ready", "status": ready, "lastTransitionTime": p.ready_changed_at},
            ],
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image or "",
                    "imageID": "",
                    "containerID": f"kvscale-node://{p.proc.pid if p.proc else 0}",
                    "ready": ready == "True",
                    "started": running,
                    "restartCount": p.restarts,
                    "state": state,
                }
            ],
        }
        try:
            self.api.patch_namespaced_pod_status(p.name, p.namespace, {"status": status})
        except ApiException as e:
            if e.status != 404:
                raise

    # -- probes and restarts -------------------------------------------------------------------
    def _probe_loop(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                pods = [p for p in self.pods.values() if not p.stopping]
            for p in pods:
                try:
                    self._probe(p)
                except ApiException as e:
                    if e.status != 404:
                        logger.warning("status update of %s/%s failed: %s", p.namespace, p.name, e.reason)
                except Exception:
                    logger.exception("probe of %s/%s failed", p.namespace, p.name)

    def _probe(self, p: PodProcess) -> None:
        pod = self.api.read_namespaced_pod(p.name, p.namespace)
        if pod.metadata.uid != p.uid or pod.metadata.deletion_timestamp is not None:
            return
        if p.proc is not None and p.proc.poll() is not None and not p.stopping:
            p.last_exit, p.ready, p.ready_changed_at = p.proc.returncode, False, _now()
            self._set_status(pod, p)
            if (pod.spec.restart_policy or "Always") != "Never":
                time.sleep(min(10, 2**p.restarts))  # crash-loop back-off, shortened for tests
                p.restarts += 1
                self._spawn(pod, p)
            return
        probe = pod.spec.containers[0].readiness_probe
        ready = (
            p.proc is not None and p.proc.poll() is None and (probe is None or self._http_ok(pod, p, probe))
        )
        if ready != p.ready:
            p.ready, p.ready_changed_at = ready, _now()
            self._set_status(pod, p)

    def _http_ok(self, pod, p: PodProcess, probe) -> bool:
        get = probe.http_get
        if get is None:
            return True  # exec / tcp probes: treated as passing once the process runs
        port = get.port
        if isinstance(port, str) and not port.isdigit():
            port = next(cp.container_port for cp in pod.spec.containers[0].ports or [] if cp.name == port)
        try:
            with urllib.request.urlopen(f"http://{p.ip}:{port}{get.path or '/'}", timeout=2) as r:
                return 200 <= r.status < 400
        except OSError:
            return False

    # -- deletion ------------------------------------------------------------------------------
    def _delete(self, pod) -> None:
        with self._lock:
            p = self.pods.get(pod.metadata.uid)
            if p is not None and p.stopping:
                return
            if p is not None:
                p.stopping = True
        if p is not None:
            container = pod.spec.containers[0]
            pre_stop = container.lifecycle.pre_stop if container.lifecycle else None
            if pre_stop is not None and pre_stop.sleep is not None:
                time.sleep(pre_stop.sleep.seconds)
            elif pre_stop is not None and pre_stop._exec is not None and pre_stop._exec.command:
                env = self._env(pod, container, p.ip)
                grace = pod.spec.termination_grace_period_seconds
                subprocess.run(pre_stop._exec.command, env=env, check=False, timeout=grace)
            self._terminate(p, grace=pod.metadata.deletion_grace_period_seconds or 30)
        try:
            # The kubelet's last word: delete now. With a body, the server reads the options from
            # it and ignores query parameters, so the grace period must be in the body.
            options = client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)
            )
            self.api.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=options)
        except ApiException as e:
            if e.status not in (404, 409):
                raise
        self._forget(pod.metadata.uid)

    def _terminate(self, p: PodProcess, grace: float) -> None:
        p.stopping = True
        if p.proc is None or p.proc.poll() is not None:
            return
        p.proc.send_signal(signal.SIGTERM)
        try:
            p.proc.wait(grace)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()

    def _forget(self, uid: str) -> None:
        with self._lock:
            p = self.pods.pop(uid, None)
            if p is None:
                return
            self._free_ips.append(p.ip)
        self._terminate(p, grace=5)
