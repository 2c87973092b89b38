"""Pydantic descriptions of the v2 messages, for the OpenAPI document only.

The hot path decodes requests itself (:mod:`slimline.serve.protocol`), so that binary tensor
data and precise 400 messages work; these models document the same shapes for clients and
schema-driven fuzzers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = [
    "ErrorBody",
    "InferenceRequest",
    "InferenceResponse",
    "LiveBody",
    "ModelMetadata",
    "ReadyBody",
    "ServerMetadata",
]

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64",
]  # fmt: skip


class TensorParameters(BaseModel):
    binary_data_size: int | None = Field(
        None, ge=0, description="bytes of this tensor in the binary section after the JSON"
    )


class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(..., description="full shape, batch dimension first")
    datatype: Datatype
    parameters: TensorParameters | None = None
    data: list[Any] | None = Field(None, description="row-major values, flat or nested")


class OutputParameters(BaseModel):
    binary_data: bool | None = None


class RequestOutput(BaseModel):
    name: str
    parameters: OutputParameters | None = None


class RequestParameters(BaseModel):
    binary_data_output: bool | None = None
    timeout: int | None = Field(None, ge=1, description="deadline in microseconds")


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: RequestParameters | None = None
    inputs: list[RequestInput] = Field(..., min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: TensorParameters | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[ResponseOutput]


class MetadataTensor(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(..., description="-1 marks a free dimension")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[MetadataTensor]
    outputs: list[MetadataTensor]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ErrorBody(BaseModel):
    error: str


class LiveBody(BaseModel):
    live: bool


class ReadyBody(BaseModel):
    ready: bool
    degraded: bool | None = None  # a cascade answers from its edge tier alone
    reason: str | None = None
