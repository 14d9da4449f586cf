"""The building blocks of the models: Kubernetes' name and value grammars, rules checked twice (CEL
in the CRD for the API server, Python in the models), quantities, object names, label keys and
values, and the camelCase base model every part of the resource is made of."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# Kubernetes' own name and value grammars (k8s.io/apimachinery/pkg/util/validation), written so
# that RE2 (CEL's `matches`, in the API server) and Python's `re` read them the same way.
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # RFC 1035: Service names
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # most object names
LABEL_KEY = (  # a qualified name: an optional DNS-subdomain prefix and `/`, a name of at most 63
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"  # and at most 63 characters
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"  # a key of a Secret or ConfigMap
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# resource.Quantity's grammar (ParseQuantity): a signed decimal, then a binary-SI, decimal-SI or
# integer-exponent suffix. CEL's isQuantity() is the API server's check; this is the models'.
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
NAME_MAX = 63  # the resource's name is a label value and the Service's name


@dataclass(frozen=True)
class Rule:
    """One validation rule, twice: CEL for the API server (refused at apply, with `message`) and
    Python for the models (specs stored under an older CRD, and the unit tests)."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    optional_old_self: bool = False  # `oldSelf` is an optional: none on create

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.cel, "message": self.message}
        if self.optional_old_self:
            out["optionalOldSelf"] = True
        return out


@functools.cache
def compiled(pattern: str) -> re.Pattern[str]:
    # RE2's `$` (CEL's `matches`) is the end of the text; Python's also matches before a final
    # newline. `\Z` is RE2's `$` in Python.
    return re.compile(pattern.replace("$", r"\Z"))


def search(pattern: str, value: str) -> bool:
    """CEL's `value.matches(pattern)`, in Python."""
    return compiled(pattern).search(value) is not None


def matches(pattern: str) -> Callable[[Any], bool]:
    return lambda value: search(pattern, value)


def cel(*rules: Rule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.schema() for r in rules]}


def checked(base: Any, *rules: Rule, **field: Any) -> Any:
    """`base` with `rules`: in the CRD as x-kubernetes-validations, in the models as a validator."""

    def validate(value: Any) -> Any:
        for rule in rules:
            if not rule.check(value):
                raise ValueError(rule.message)
        return value

    return Annotated[base, Field(json_schema_extra=cel(*rules), **field), AfterValidator(validate)]


def _quantity_positive(value: str) -> bool:
    match = compiled(QUANTITY).search(value)
    return match is not None and not value.startswith("-") and float(match.group(1)) > 0


def Quantity(what: str) -> Any:
    return checked(
        str,
        Rule(
            # isGreaterThan, not sign(): measured on kube-apiserver v1.37, checking a field's
            # default against the rule finds "no matching overload for 'sign'" and refuses the CRD.
            "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
            f"must be a positive Kubernetes quantity such as {what}",
            _quantity_positive,
        ),
        max_length=64,
    )


def ObjectName(what: str, max_length: int = 253) -> Any:
    return checked(
        str,
        Rule(
            f"self.matches(r'{DNS_SUBDOMAIN}')",
            f"must be the name of {what}: lowercase letters, digits, '-' and '.', starting and "
            "ending with a letter or digit",
            matches(DNS_SUBDOMAIN),
        ),
        min_length=1,
        max_length=max_length,
    )


LabelValue = checked(
    str,
    Rule(
        f"self.matches(r'{LABEL_VALUE}')",
        "must be a label value: at most 63 letters, digits, '-', '_' and '.', starting and ending "
        "with a letter or digit",
        matches(LABEL_VALUE),
    ),
    max_length=63,
)

KEYS_RULE = Rule(
    f"self.all(k, size(k) <= 317 && k.matches(r'{LABEL_KEY}'))",
    "keys must be label keys: an optional DNS-subdomain prefix and '/', then at most 63 letters, "
    "digits, '-', '_' and '.', starting and ending with a letter or digit",
    lambda m: all(len(k) <= 317 and search(LABEL_KEY, k) for k in m),
)
# A map whose keys are label keys (node selectors, pod labels and annotations).
LabelMap = checked(dict[str, LabelValue], KEYS_RULE, max_length=64)

# The resource's name becomes the children's names, the Service's (a DNS-1035 label) included,
# and a label value on every worker (at most 63). A rule on metadata.name must sit at the root,
# where every status write runs it too: checked on create only (a name never changes), so a
# resource created under an older CRD still takes status writes.
NAME_RULE = Rule(
    f"oldSelf.hasValue() || (size(self.metadata.name) <= {NAME_MAX} && "
    f"self.metadata.name.matches(r'{DNS_LABEL}'))",
    f"metadata.name must be at most {NAME_MAX} lowercase letters, digits and '-', starting with a "
    "letter and ending with a letter or digit: it names the workers' Service and is a label value",
    lambda name: len(name) <= NAME_MAX and search(DNS_LABEL, name),
    optional_old_self=True,
)


def name_problem(name: str) -> str | None:
    """Why a resource's name cannot name its children (None: it can). The CRD refuses such names;
    this is for resources stored under an older CRD."""
    return None if NAME_RULE.check(name) else NAME_RULE.message


class CamelModel(BaseModel):
    """camelCase on the wire; `rules` are object-level rules, in the CRD and in the models."""

    rules: ClassVar[tuple[Rule, ...]] = ()

    @staticmethod
    def _rules_schema(schema: dict[str, Any], cls: type) -> None:
        if getattr(cls, "rules", ()):
            schema.update(cel(*cls.rules))

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_rules_schema,
    )

    @model_validator(mode="after")
    def _check_rules(self) -> CamelModel:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self


LabelKey = checked(
    str,
    Rule(
        f"self.matches(r'{LABEL_KEY}')",
        "must be a label key: an optional DNS-subdomain prefix and '/', then at most 63 letters, "
        "digits, '-', '_' and '.', starting and ending with a letter or digit",
        matches(LABEL_KEY),
    ),
    max_length=317,
)


def unique(items: list[Any], key: Callable[[Any], Any], what: str) -> list[Any]:
    keys = [key(i) for i in items]
    dupes = sorted({str(k) for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"{what} must be unique: {', '.join(dupes)} repeated")
    return items


def list_map(*keys: str) -> dict[str, Any]:
    """A list merged by key (server-side apply, strategic merge), whose keys the API server
    refuses to see twice."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}
