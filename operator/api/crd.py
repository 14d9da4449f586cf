"""Generate the CustomResourceDefinition (and the reference docs) from the pydantic models.

    kvscale-operator crd > crds/inferencedeployments.kvscale.dev.yaml
    kvscale-operator crd --endpoint > crds/inferenceendpoints.kvscale.dev.yaml
    kvscale-operator crd --markdown   # the field reference of docs/operator.md

Pydantic's JSON Schema becomes a Kubernetes structural schema: references inlined, optional
fields as plain (not nullable) properties, `exclusiveMinimum` in the OpenAPI v3.0 form, CEL rules
as `x-kubernetes-validations`, and status open for kopf's bookkeeping.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from kvscale.operator.api.endpoint import (
    ENDPOINT_KIND,
    ENDPOINT_PLURAL,
    InferenceEndpointSpec,
    InferenceEndpointStatus,
)
from kvscale.operator.api.groupversion import GROUP, KIND, PLURAL, VERSION
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.status import InferenceDeploymentStatus
from kvscale.operator.api.validation import NAME_RULE

SHORT_NAMES = ["infd"]
# Keys with no place in a structural schema: k8s prunes unknown fields itself (and kubectl's strict
# field validation reports them), and forbids additionalProperties beside properties.
DROP = {"title", "$defs"}


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        target = defs[schema["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in schema:  # `X | None`: the field is optional, never null
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        assert len(options) == 1, f"unsupported union: {schema['anyOf']}"
        rest = {
            k: v
            for k, v in schema.items()
            if k not in ("anyOf", "default") or (k == "default" and v is not None)
        }
        return _structural({**options[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DROP:
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "additionalProperties" and value is False:
            continue
        elif key == "additionalProperties" and value is True:  # `dict[str, Any]`: kept as it is
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "const":
            out["enum"] = [value]
        elif key == "default" and value is None:
            continue
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        kinds = {type(v) for v in out["enum"]}
        out["type"] = "integer" if kinds == {int} else "string"
    if out.get("type") == "object" and "properties" in out and not out.get("required"):
        out.pop("required", None)
    return out


def schema_of(model) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    return _structural(raw, raw.get("$defs", {}))


def status_schema(model=InferenceDeploymentStatus) -> dict[str, Any]:
    schema = schema_of(model)
    schema.pop("x-kubernetes-preserve-unknown-fields", None)  # unknown fields are pruned, not kept
    # kopf keeps its progress and diff base under status.kopf, in its own shape.
    schema["properties"]["kopf"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return schema


def _crd(
    kind: str,
    plural: str,
    short_names: list[str],
    spec_model,
    status_model,
    subresources: dict[str, Any],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["kvscale"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": spec_model.__doc__,
                            "required": ["spec"],
                            # CEL sees metadata.name only from the root.
                            "x-kubernetes-validations": [NAME_RULE.schema()],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": schema_of(spec_model),
                                "status": status_schema(status_model),
                            },
                        }
                    },
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def crd() -> dict[str, Any]:
    return _crd(
        KIND,
        PLURAL,
        SHORT_NAMES,
        InferenceDeploymentSpec,
        InferenceDeploymentStatus,
        {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        [
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
            {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
            {
                "name": "KV Usage",
                "type": "number",
                "format": "float",
                "jsonPath": ".status.kvCacheUsage",
            },
            {
                "name": "Status",
                "type": "string",
                "jsonPath": ".status.conditions[?(@.type=='Ready')].reason",
            },
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def endpoint_crd() -> dict[str, Any]:
    """The InferenceEndpoint (api/endpoint.py)."""
    return _crd(
        ENDPOINT_KIND,
        ENDPOINT_PLURAL,
        ["infe"],
        InferenceEndpointSpec,
        InferenceEndpointStatus,
        {"status": {}},
        [
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
            {"name": "Models", "type": "string", "jsonPath": ".status.models[*].name"},
            {
                "name": "Status",
                "type": "string",
                "jsonPath": ".status.conditions[?(@.type=='Ready')].reason",
            },
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def crd_yaml(endpoint: bool = False) -> str:
    flag = " --endpoint" if endpoint else ""
    header = f"# Generated from kvscale.operator.api by `kvscale-operator crd{flag}`; do not edit by hand.\n"
    body = endpoint_crd() if endpoint else crd()
    return header + yaml.dump(body, Dumper=_NoAliases, sort_keys=False, width=100)


class _NoAliases(yaml.SafeDumper):
    """Write repeated sub-schemas out in full: anchors and aliases confuse readers and diff tools."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def reference_markdown(endpoint: bool = False) -> str:
    """The field reference for docs/operator.md (of the InferenceEndpoint with `endpoint`), from
    the same schema."""
    spec_model = InferenceEndpointSpec if endpoint else InferenceDeploymentSpec
    status_model = InferenceEndpointStatus if endpoint else InferenceDeploymentStatus
    lines = ["| field | type | default | description |", "|---|---|---|---|"]

    def walk(schema: dict[str, Any], prefix: str, required: set[str]) -> None:
        for name, sub in schema.get("properties", {}).items():
            path = f"{prefix}.{name}" if prefix else name
            kind = sub.get("type", "")
            if kind == "array" and "items" in sub:
                kind = f"[]{sub['items'].get('type', '')}"
            if "enum" in sub:
                kind = " \\| ".join(f"`{v}`" for v in sub["enum"])
            bounds = [f"≥ {sub['minimum']}" if "minimum" in sub and not sub.get("exclusiveMinimum") else ""]
            bounds += [f"> {sub['minimum']}" if sub.get("exclusiveMinimum") else ""]
            bounds += [f"≤ {sub['maximum']}" if "maximum" in sub else ""]
            bounds = ", ".join(b for b in bounds if b)
            default = (
                f"`{json.dumps(sub['default'])}`"
                if "default" in sub
                else ("required" if name in required else "")
            )
            desc = (sub.get("description") or "").replace("\n", " ")
            rules = [v["message"] for v in sub.get("x-kubernetes-validations", [])]
            extra = "; ".join(x for x in [bounds, *rules] if x)
            lines.append(f"| `{path}` | {kind} | {default} | {desc}{' (' + extra + ')' if extra else ''} |")
            if sub.get("type") == "object":
                walk(sub, path, set(sub.get("required", [])))
            elif sub.get("type") == "array" and sub.get("items", {}).get("type") == "object":
                walk(sub["items"], path + "[]", set(sub["items"].get("required", [])))

    spec = schema_of(spec_model)
    walk(spec, "spec", set(spec.get("required", [])))
    rules = [v["message"] for v in spec.get("x-kubernetes-validations", [])]
    lines.append("")
    lines.extend(f"Rule on `spec`: {r}." for r in rules)
    lines.append(f"Rule on the resource: {NAME_RULE.message}.")
    lines.append("")
    lines.append("| status field | type | description |")
    lines.append("|---|---|---|")
    for name, sub in status_schema(status_model)["properties"].items():
        if name != "kopf":
            lines.append(f"| `status.{name}` | {sub.get('type', '')} | {sub.get('description', '')} |")
    return "\n".join(lines) + "\n"
