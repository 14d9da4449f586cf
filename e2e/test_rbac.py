"""RBAC on the real node, with the OwnerReferencesPermissionEnforcement admission plugin on (as
OpenShift and hardened clusters run it; e2e/controlplane): the operator adopts orphaned
children (a write that changes an existing object's ownerReferences needs `delete` on it), and
the namespaced install (manifests/namespaced/) serves its namespace with no cluster-wide right
and no request outside its namespaces. (Setting blockOwnerDeletion at all, `update` on
inferencedeployments/finalizers, is what every other operator test does; the audit test in
e2e/test_operator.py checks that the plugin refused none of it.)"""

from __future__ import annotations

import json

import pytest
import yaml
from audit import audit_lines, operator_requests
from kubernetes import client
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    OPERATOR,
    OPERATOR_NS,
    REPO,
    apply,
    condition,
    example,
    get_cr,
    namespace,
    operator,
    operator_pods,
    wait_for_new_leader,
)

CHILD_READERS = {
    "Deployment": lambda api: client.AppsV1Api(api).read_namespaced_deployment,
    "Service": lambda api: client.CoreV1Api(api).read_namespaced_service,
    "PodDisruptionBudget": lambda api: client.PolicyV1Api(api).read_namespaced_pod_disruption_budget,
}
CHILDREN = {"deployments", "services", "poddisruptionbudgets"}


def owner_uids(cluster, name: str, ns: str) -> dict[str, list[str]]:
    """Each child's ownerReferences' uids (and that each blocks its owner's deletion)."""
    out = {}
    for kind, reader in CHILD_READERS.items():
        refs = reader(cluster.api)(name, ns).metadata.owner_references or []
        assert all(r.block_owner_deletion and r.controller for r in refs), (kind, refs)
        out[kind] = [r.uid for r in refs]
    return out


def owned_by(cluster, name: str, ns: str, uid: str) -> bool:
    try:
        return all(uids == [uid] for uids in owner_uids(cluster, name, ns).values())
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise


def refused(events: list[dict]) -> list[tuple]:
    return [
        (e["verb"], e["requestURI"], e["responseStatus"].get("message"))
        for e in events
        if e.get("responseStatus", {}).get("code") == 403
    ]


def test_orphaned_children_are_adopted_under_the_owner_reference_admission_plugin(operator, namespace):  # noqa: F811
    """`kubectl delete infd --cascade=orphan` leaves the children without an owner; applying the
    resource again makes the operator's apply add the new owner to existing objects, which the
    plugin allows only with `delete` on them (and `update` on the owner's finalizers)."""
    if not operator.local:
        pytest.skip("reads the local API server's audit log")
    doc = example("orphan", namespace, replicas=0)  # no worker pods: only the children matter
    apply(operator, doc)
    first = get_cr(operator, "orphan", namespace)["metadata"]["uid"]
    wait_for(lambda: owned_by(operator, "orphan", namespace, first), timeout=60, what="the children")

    operator.kubectl("delete", "infd", "orphan", "-n", namespace, "--cascade=orphan", "--timeout=60s")
    wait_for(
        lambda: all(uids == [] for uids in owner_uids(operator, "orphan", namespace).values()),
        timeout=60,
        what="the garbage collector to orphan the children",
    )
    mark = audit_lines(operator)
    apply(operator, doc)
    second = get_cr(operator, "orphan", namespace)["metadata"]["uid"]
    assert second != first
    wait_for(
        lambda: owned_by(operator, "orphan", namespace, second),
        timeout=60,
        interval=0.5,
        what="the operator to adopt the orphaned children",
    )
    cr = get_cr(operator, "orphan", namespace)
    assert condition(cr, "Degraded").get("reason") not in ("ApplyRejected", "ApplyFailed"), cr["status"]
    writes = [
        e
        for e in operator_requests(operator, mark, namespace)
        if e["objectRef"]["resource"] in CHILDREN and e["verb"] == "patch"
    ]
    assert writes, "no apply of the children was seen"
    assert not refused(writes), refused(writes)


def render_namespaced(cluster, watched: str) -> list[dict]:
    """manifests/namespaced/ as kustomize renders it, its example namespace replaced by ours."""
    text = cluster.kubectl("kustomize", str(REPO / "manifests" / "namespaced")).stdout
    return [d for d in yaml.safe_load_all(text.replace("kvscale-workloads", watched)) if d]


def test_the_namespaced_install_serves_its_namespace_with_no_cluster_wide_right(operator, namespace):  # noqa: F811
    """The installed operator switched to manifests/namespaced/ (watching only `namespace`) and
    its ClusterRoleBinding removed: it reconciles a resource there, every request it makes is in
    its namespaces, none is refused; then the cluster-wide install is restored."""
    if not operator.local:
        pytest.skip("reads the local API server's audit log")
    objects = render_namespaced(operator, namespace)
    assert not [o for o in objects if o["kind"].startswith("Cluster")]
    before = operator_pods(operator)
    try:
        for obj in objects:
            operator.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))
        wait_for_new_leader(operator, before)
        # From here on nothing cluster-wide is granted: the namespaced pods run on their Roles.
        operator.kubectl("delete", "clusterrolebinding", OPERATOR)
        mark = audit_lines(operator)
        apply(operator, example("scoped", namespace, replicas=0))
        uid = get_cr(operator, "scoped", namespace)["metadata"]["uid"]
        wait_for(
            lambda: owned_by(operator, "scoped", namespace, uid),
            timeout=60,
            interval=0.5,
            what="the namespaced operator to create the children",
        )

        def reported():
            cr = get_cr(operator, "scoped", namespace)
            status = cr.get("status") or {}
            return cr if status.get("observedGeneration") == cr["metadata"]["generation"] else None

        wait_for(reported, timeout=60, interval=0.5, what="the namespaced operator to write status")
        requests = operator_requests(operator, mark)
        assert requests
        assert not refused(requests), refused(requests)
        outside = sorted(
            {
                (e["verb"], e["requestURI"])
                for e in requests
                if e["objectRef"].get("namespace") not in (namespace, OPERATOR_NS)
            }
        )
        assert not outside, f"requests outside the watched namespaces: {outside}"
    finally:
        # The cluster-wide install again (the same field manager: the overlay's env goes), then
        # its pods lead (a rollout only if the overlay's Deployment was applied).
        during = operator_pods(operator)
        switched = "KVSCALE_WATCH_NAMESPACES" in json.dumps(deployment(operator).to_dict(), default=str)
        operator.kubectl("apply", "--server-side", "-k", str(REPO / "manifests"))
        if switched:
            wait_for_new_leader(operator, during)
    assert "KVSCALE_WATCH_NAMESPACES" not in json.dumps(deployment(operator).to_dict(), default=str)


def deployment(cluster):
    return client.AppsV1Api(cluster.api).read_namespaced_deployment(OPERATOR, OPERATOR_NS)


def can_i(cluster, user: str, verb: str, resource: str, ns: str, subresource: str = "") -> bool:
    extra = [f"--subresource={subresource}"] if subresource else []
    answer = cluster.kubectl("auth", "can-i", verb, resource, *extra, "-n", ns, "--as", user, check=False)
    return answer.stdout.strip() == "yes"


def test_namespace_editors_manage_and_viewers_read_inferencedeployments(operator, namespace):  # noqa: F811
    """manifests/user-roles.yaml, aggregated into the built-in edit and view ClusterRoles: a user
    bound to `edit` in a namespace manages InferenceDeployments there, one bound to `view` reads
    them; neither writes status, and neither has rights in another namespace."""
    rbac = client.RbacAuthorizationV1Api(operator.api)
    if not rbac.read_cluster_role("edit").rules:
        pytest.skip(
            "the built-in edit role has no rules: the control plane runs no "
            "clusterrole-aggregation-controller (e2e/controlplane/main.go, controllers)"
        )
    resource = "inferencedeployments.kvscale.dev"
    wait_for(
        lambda: any(
            resource.split(".")[0] in (r.resources or []) for r in rbac.read_cluster_role("view").rules
        ),
        timeout=30,
        what="the aggregation of kvscale-inferencedeployments-view into view",
    )
    for user, role in (("e2e-editor", "edit"), ("e2e-viewer", "view")):
        operator.kubectl(
            "create",
            "rolebinding",
            f"{user}-{role}",
            f"--clusterrole={role}",
            f"--user={user}",
            "-n",
            namespace,
        )
    editor = {
        v: can_i(operator, "e2e-editor", v, resource, namespace) for v in ("create", "patch", "delete", "get")
    }
    assert all(editor.values()), editor
    assert can_i(operator, "e2e-editor", "update", resource, namespace, "scale")
    assert can_i(operator, "e2e-viewer", "list", resource, namespace)
    assert can_i(operator, "e2e-viewer", "watch", resource, namespace)
    assert not can_i(operator, "e2e-viewer", "create", resource, namespace)
    assert not can_i(operator, "e2e-editor", "patch", resource, namespace, "status")
    assert not can_i(operator, "e2e-editor", "get", resource, OPERATOR_NS)


OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR}"


def test_the_operator_patches_pods_only_where_a_rolebinding_grants_it(operator, namespace):  # noqa: F811
    """manifests/rbac.yaml grants no cluster-wide `pods: patch` (it could change any pod's
    image); kvscale-operator-pod-marks, bound in one namespace, grants it there only."""
    assert not can_i(operator, OPERATOR_USER, "patch", "pods", namespace)
    assert not can_i(operator, OPERATOR_USER, "patch", "pods", "kube-system")
    assert can_i(operator, OPERATOR_USER, "list", "pods", namespace)
    operator.kubectl(
        "create", "rolebinding", "kvscale-operator-pod-marks", "-n", namespace,
        "--clusterrole=kvscale-operator-pod-marks", f"--serviceaccount={OPERATOR_NS}:{OPERATOR}",
    )  # fmt: skip
    assert can_i(operator, OPERATOR_USER, "patch", "pods", namespace)
    assert not can_i(operator, OPERATOR_USER, "patch", "pods", "kube-system")


def test_confused_deputy_specs_are_refused_and_anothers_service_is_not_taken(operator, namespace):  # noqa: F811
    """A Service of the resource's name made by someone else stays theirs (ChildConflict names
    it); a spec the default admin policy refuses (priorityClassName, a toleration of every
    taint, env reading a Secret it does not name) creates nothing; a Hub token to a plain-http
    endpoint is refused by the policy."""
    core = client.CoreV1Api(operator.api)
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "taken", "namespace": namespace, "labels": {"app": "theirs"}},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
    }
    operator.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(theirs))
    apply(operator, example("taken", namespace, replicas=0))

    def degraded(name: str) -> dict | None:
        c = condition(get_cr(operator, name, namespace), "Degraded")
        return c if c.get("status") == "True" else None

    c = wait_for(lambda: degraded("taken"), timeout=60, interval=0.5, what="the ChildConflict")
    assert c["reason"] == "ChildConflict" and f"Service {namespace}/taken" in c["message"], c
    svc = core.read_namespaced_service("taken", namespace)
    assert svc.spec.selector == {"app": "theirs"} and not svc.metadata.owner_references

    doc = example("deputy", namespace, replicas=0)
    doc["spec"]["priorityClassName"] = "system-cluster-critical"
    doc["spec"]["tolerations"] = [{"operator": "Exists"}]
    doc["spec"]["env"] = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "someone-elses", "key": "k"}}}]
    apply(operator, doc)
    c = wait_for(lambda: degraded("deputy"), timeout=60, interval=0.5, what="the PolicyViolation")
    assert c["reason"] == "PolicyViolation", c
    for field in ("spec.priorityClassName", "spec.tolerations[0]", "spec.env[X]"):
        assert field in c["message"], c
    with pytest.raises(client.ApiException) as e:
        client.AppsV1Api(operator.api).read_namespaced_deployment("deputy", namespace)
    assert e.value.status == 404

    bad = example("leak", namespace, replicas=0)
    bad["spec"]["model"] = {
        "uri": "hf://org/model",
        "hfTokenSecret": {"name": "hub"},
        "hfEndpoint": "http://mirror.internal",
    }
    apply(operator, bad)  # the schema admits it: https is the admin policy's rule (docs/operator.md)
    c = wait_for(lambda: degraded("leak"), timeout=60, interval=0.5, what="the plain-http Hub refused")
    assert c["reason"] == "PolicyViolation" and "spec.model.hfEndpoint" in c["message"], c


def test_the_network_policies_are_applied_and_select_the_real_pods(operator, namespace):  # noqa: F811
    """The per-resource NetworkPolicies pass the API server's validation and select the pods the
    Deployments run (enforcement needs a NetworkPolicy engine, which this node does not run:
    docs/operator.md, "NetworkPolicies")."""
    apply(operator, example("netpol", namespace, replicas=0))
    net = client.NetworkingV1Api(operator.api)

    def applied():
        try:
            return net.read_namespaced_network_policy(
                "netpol", namespace
            ), net.read_namespaced_network_policy("netpol-router", namespace)
        except client.ApiException as e:
            if e.status != 404:
                raise
            return None

    workers, router = wait_for(applied, timeout=60, interval=0.5, what="the NetworkPolicies")
    apps = client.AppsV1Api(operator.api)
    worker_labels = apps.read_namespaced_deployment("netpol", namespace).spec.template.metadata.labels
    router_labels = apps.read_namespaced_deployment("netpol-router", namespace).spec.template.metadata.labels
    assert workers.spec.pod_selector.match_labels.items() <= worker_labels.items()
    assert router.spec.pod_selector.match_labels.items() <= router_labels.items()
    assert not router.spec.pod_selector.match_labels.items() <= worker_labels.items()
    peer = workers.spec.ingress[0]._from[0].pod_selector.match_labels
    assert peer.items() <= router_labels.items()
    # The API, and the KV events the routers subscribe to (the precise index, the default).
    assert [p.port for p in workers.spec.ingress[0].ports] == [8000, 5557, 5558]
    assert workers.metadata.owner_references[0].name == "netpol"


def test_the_admission_policy_admits_the_operators_children_and_refuses_an_escalation(operator, namespace):  # noqa: F811
    """manifests/admission/ on the real API server: the operator still applies every child (a
    worker and its router), and a write as the operator's ServiceAccount that would run a pod on
    the host's network, or bind its rights elsewhere, is refused."""
    operator.kubectl("apply", "--server-side", "-k", str(REPO / "manifests" / "admission"))
    try:
        hostile = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": "escalate",
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "kvscale-operator"},
            },
            "spec": {
                "selector": {"matchLabels": {"app": "x"}},
                "template": {
                    "metadata": {"labels": {"app": "x"}},
                    "spec": {
                        "hostNetwork": True,
                        "automountServiceAccountToken": False,
                        "containers": [
                            {
                                "name": "x",
                                "image": "x",
                                "securityContext": {"allowPrivilegeEscalation": False},
                            }
                        ],
                    },
                },
            },
        }
        as_operator = ["--as", OPERATOR_USER]

        def write_hostile(*dry_run: str):
            return operator.kubectl(
                "apply",
                "--server-side",
                *as_operator,
                *dry_run,
                "-f",
                "-",
                input=json.dumps(hostile),
                check=False,
            )

        # The API server loads a new policy and binding from its informers, moments after they
        # exist (CI's faster machine wrote the hostile Deployment before): a server-side dry run,
        # which runs admission, says when the policy is in force, and the children below are then
        # admitted under it.
        wait_for(
            lambda: "no host network" in write_hostile("--dry-run=server").stderr,
            timeout=30,
            interval=0.5,
            what="the admission policy in force",
        )
        apply(operator, example("vap", namespace, replicas=0))
        uid = get_cr(operator, "vap", namespace)["metadata"]["uid"]

        def applied():
            cr = get_cr(operator, "vap", namespace)
            status = cr.get("status") or {}
            return cr if status.get("observedGeneration") == cr["metadata"]["generation"] else None

        cr = wait_for(applied, timeout=90, interval=0.5, what="every child applied under the policy")
        assert condition(cr, "Degraded").get("status") == "False", cr["status"]
        assert owned_by(operator, "vap", namespace, uid)
        out = write_hostile()
        assert out.returncode != 0 and "no host network" in out.stderr, out.stderr
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {
                "name": "vap-router",
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "kvscale-operator"},
            },
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "vap-router"},
            "subjects": [{"kind": "ServiceAccount", "name": "intruder", "namespace": namespace}],
        }
        out = operator.kubectl(
            "apply",
            "--server-side",
            *as_operator,
            "--force-conflicts",
            "-f",
            "-",
            input=json.dumps(binding),
            check=False,
        )
        assert out.returncode != 0 and "binds its own Role" in out.stderr, out.stderr
    finally:
        operator.kubectl(
            "delete", "-k", str(REPO / "manifests" / "admission"), "--ignore-not-found", check=False
        )
