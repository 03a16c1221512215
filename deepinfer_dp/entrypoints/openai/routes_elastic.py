"""vLLM's elastic EP routes: POST /scale_elastic_ep grows or shrinks the DP group while the
server keeps serving (cluster/elastic.py), GET /is_scaling_elastic_ep says whether a change is
under way. They work on a server started with --enable-elastic-ep (dp_size > 1 over Ray, one
API server); elsewhere they answer 404 saying so.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, Field

from deepinfer_dp.cluster.elastic import ScaleError
from deepinfer_dp.entrypoints.openai.errors import error_response
from deepinfer_dp.entrypoints.openai.protocol import ErrorResponse

DEFAULT_DRAIN_TIMEOUT_S = 120.0  # vLLM's default for the endpoint
NOT_ENABLED = ("elastic scaling is off: start the server with --enable-elastic-ep (it needs dp_size > 1 over Ray "
               "and one API server)")


class Scaler(Protocol):
    """What the routes need of the deployment (cluster/deployment.py's DPDeployment)."""

    def scale(self, new_size: int, drain_timeout_s: float) -> dict: ...

    def is_scaling(self) -> bool: ...


class ScaleRequest(BaseModel):
    new_data_parallel_size: int = Field(description="the DP group's size after the change")
    drain_timeout: float = Field(DEFAULT_DRAIN_TIMEOUT_S, ge=0, description="seconds a leaving rank's "
                                 "requests may take to finish before they move to the staying ranks")


class ScaleResponse(BaseModel):
    message: str
    old_size: int
    new_size: int
    seconds: float
    migrated: int  # requests moved to a staying rank by recompute


class IsScalingResponse(BaseModel):
    is_scaling_elastic_ep: bool


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "A size the group cannot take"},
    404: {"model": ErrorResponse, "description": "The server was started without --enable-elastic-ep"},
    409: {"model": ErrorResponse, "description": "A change is already in progress"},
    503: {"model": ErrorResponse, "description": "The change failed; the group is as it was"}}


def install(app: FastAPI, scaler: Scaler | None) -> None:
    router = APIRouter()

    @router.post("/scale_elastic_ep", responses=_ERRORS)
    async def scale_elastic_ep(req: ScaleRequest):
        if scaler is None:
            return error_response(404, NOT_ENABLED, code="elastic_ep_disabled")
        try:  # minutes, in a worker thread: the event loop keeps streaming tokens meanwhile
            done = await asyncio.to_thread(scaler.scale, req.new_data_parallel_size, req.drain_timeout)
        except ScaleError as e:
            kind = "invalid_request_error" if e.status < 500 else "service_unavailable_error"
            param = "new_data_parallel_size" if e.status == 400 else None
            return error_response(e.status, str(e), kind, param)
        return ScaleResponse(message=f"Scaled to {done['new_size']} data parallel engines", **done)

    @router.get("/is_scaling_elastic_ep", responses={404: _ERRORS[404]})
    def is_scaling_elastic_ep():  # plain def: asks the router over Ray, in FastAPI's thread pool
        if scaler is None:
            return error_response(404, NOT_ENABLED, code="elastic_ep_disabled")
        return IsScalingResponse(is_scaling_elastic_ep=scaler.is_scaling())

    app.include_router(router)
