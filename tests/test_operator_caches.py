"""The caches in the spec (issue 29): a compile cache volume the workers share (spec.compileCache,
mounted at $KVSCALE_COMPILE_CACHE), and a model cache filled once and shared read-only
(model.cacheClaim with model.cacheReadOnly): validated by the CRD, the models and the admin
policy, and rendered into the worker pods."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_operator_specs import crd_errors, resource, spec_of

from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile.admin_policy import AdminPolicy, check
from kvscale.operator.reconcile.children import Owner, deployment
from kvscale.worker.cli import main as worker_cli
from kvscale.worker.model.download import MARKER

OWNER = Owner("tiny", "ns", "uid-1")


def pod_spec(**fields) -> dict:
    spec = InferenceDeploymentSpec.model_validate(spec_of(**fields))
    return deployment(OWNER, spec, "worker:1")["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}


def test_a_compile_cache_claim_is_mounted_where_the_worker_looks_for_its_packages():
    spec = pod_spec(compileCache={"claim": "compiled"})
    (worker,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["compile-cache"] == {
        "name": "compile-cache",
        "persistentVolumeClaim": {"claimName": "compiled"},
    }
    assert {"name": "compile-cache", "mountPath": "/var/cache/kvscale"} in worker["volumeMounts"]
    env = env_of(worker)
    assert env["KVSCALE_COMPILE_CACHE"] == "/var/cache/kvscale/compiled"
    assert env["TRITON_CACHE_DIR"] == "/var/cache/kvscale/triton"  # GPUs: Triton's kernels too
    assert [v["name"] for v in worker["env"]].count("TRITON_CACHE_DIR") == 1


def test_a_read_only_compile_cache_is_mounted_read_only_and_triton_keeps_its_tmp():
    spec = pod_spec(compileCache={"claim": "compiled", "readOnly": True})
    (worker,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["compile-cache"]["persistentVolumeClaim"] == {"claimName": "compiled", "readOnly": True}
    mount = next(m for m in worker["volumeMounts"] if m["name"] == "compile-cache")
    assert mount["readOnly"] is True
    env = env_of(worker)
    assert env["KVSCALE_COMPILE_CACHE"] == "/var/cache/kvscale/compiled"
    assert env["TRITON_CACHE_DIR"] == "/tmp/triton"


def test_without_a_compile_cache_nothing_is_mounted_and_the_user_may_point_elsewhere():
    spec = pod_spec()
    (worker,) = spec["containers"]
    assert "compile-cache" not in {v["name"] for v in spec["volumes"]}
    assert "KVSCALE_COMPILE_CACHE" not in env_of(worker)
    # The user's variable wins over ours, as everywhere in env.
    spec = pod_spec(compileCache={"claim": "c"}, env=[{"name": "KVSCALE_COMPILE_CACHE", "value": "/x"}])
    (worker,) = spec["containers"]
    assert env_of(worker)["KVSCALE_COMPILE_CACHE"] == "/x"
    assert [v["name"] for v in worker["env"]].count("KVSCALE_COMPILE_CACHE") == 1


def test_a_read_only_model_cache_is_checked_not_downloaded_and_mounted_read_only_everywhere():
    spec = pod_spec(model={"uri": "hf://kvscale/tiny@v1", "cacheClaim": "models", "cacheReadOnly": True})
    (init,) = spec["initContainers"]
    (worker,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["hf-models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert init["args"][-1] == "--check"
    assert {"name": "hf-models", "mountPath": "/models/hf", "readOnly": True} in init["volumeMounts"]
    assert {"name": "hf-models", "mountPath": "/models/hf", "readOnly": True} in worker["volumeMounts"]
    # Without cacheReadOnly the init container downloads into the claim (read-write).
    (init,) = pod_spec(model={"uri": "hf://kvscale/tiny@v1", "cacheClaim": "models"})["initContainers"]
    assert "--check" not in init["args"]
    assert {"name": "hf-models", "mountPath": "/models/hf"} in init["volumeMounts"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": {"uri": "hf://a/b", "cacheReadOnly": True}}, "cacheReadOnly needs cacheClaim"),
        (
            {"compileCache": {"claim": "Compiled_Cache"}},
            "must be the name of a PersistentVolumeClaim",
        ),
    ],
)
def test_bad_cache_specs_are_refused_by_the_crd_and_the_models(fields, message):
    errors = crd_errors(resource(spec_of(**fields)))
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError, match=message):
        InferenceDeploymentSpec.model_validate(spec_of(**fields))


def test_the_admin_policys_claims_cover_the_compile_cache():
    policy = AdminPolicy.model_validate({"claims": ["models-*", "compiled-*"]})
    ok = InferenceDeploymentSpec.model_validate(spec_of(compileCache={"claim": "compiled-llama"}))
    assert check(ok, policy) == []
    other = InferenceDeploymentSpec.model_validate(spec_of(compileCache={"claim": "billing-db"}))
    assert [v.field for v in check(other, policy)] == ["spec.compileCache.claim"]


def test_the_downloaders_check_reads_the_marker_alone(tmp_path):
    """`kvscale-worker download --check`, the init container of a read-only model cache: 0 when
    the snapshot's marker is there (for its branch or its commit), else 1 with a line saying how to
    fill the cache, in the termination log; it writes nothing into the folder."""
    dest, log = tmp_path / "cache" / "kvscale" / "tiny" / "main", tmp_path / "termination-log"
    argv = ["download", "hf://kvscale/tiny", "--dest", str(dest), "--termination-log", str(log), "--check"]
    assert worker_cli(argv) == 1
    reason = log.read_text()
    assert "hf://kvscale/tiny@main is not in the read-only model cache" in reason
    assert f"kvscale-worker download hf://kvscale/tiny@main --dest {dest}" in reason
    assert not dest.exists()
    dest.mkdir(parents=True)
    commit = "a" * 40
    (dest / MARKER).write_text(f'{{"repo": "kvscale/tiny", "revision": "main", "commit": "{commit}"}}')
    assert worker_cli(argv) == 0
    argv[1] = f"hf://kvscale/tiny@{commit}"
    assert worker_cli(argv) == 0
    argv[1] = "hf://kvscale/other"
    assert worker_cli(argv) == 1
    assert sorted(p.name for p in dest.iterdir()) == [MARKER]
