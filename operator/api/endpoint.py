"""The InferenceEndpoint: one router, one URL, in front of several InferenceDeployments (one model
each) that name it in `spec.router.endpoint`. Its own resource rather than a field every member
repeats: the shared router then has one controller owner (garbage-collected with the endpoint, not
with whichever member happens to go last), one place for router settings that members could
otherwise set differently, and one status that lists the models behind it."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from kvscale.operator.api.routing import RouterSettings
from kvscale.operator.api.status import Condition
from kvscale.operator.api.validation import CamelModel, list_map

ENDPOINT_KIND, ENDPOINT_PLURAL = "InferenceEndpoint", "inferenceendpoints"


class InferenceEndpointSpec(CamelModel):
    """One OpenAI endpoint for many models: the InferenceDeployments of its namespace whose
    spec.router.endpoint names it are its pools; a request's `model` picks the pool."""

    router: RouterSettings = Field(
        default_factory=RouterSettings, description="The shared router's pods (NAME, its Service NAME)."
    )


class EndpointModel(CamelModel):
    """A model served behind the endpoint."""

    name: str = Field(description="The model name requests use (its servedName).")
    inference_deployment: str = Field(description="The InferenceDeployment that serves it.")
    adapters: list[str] = Field(default_factory=list, description="Its LoRA adapters, served by name too.")


class InferenceEndpointStatus(CamelModel):
    """What the operator observed; written by the operator only."""

    model_config = ConfigDict(extra="allow")  # kopf keeps its bookkeeping under status.kopf

    observed_generation: int | None = Field(default=None, description="The spec generation last acted on.")
    endpoint: str | None = Field(default=None, description="The OpenAI endpoint clients use.")
    models: list[EndpointModel] = Field(
        default_factory=list,
        json_schema_extra=list_map("name"),
        description="The models behind the endpoint, in the order their InferenceDeployments joined.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra=list_map("type"),
        description="Ready (the router applied; False with the reason when a member was left out or "
        "a child could not be applied).",
    )
