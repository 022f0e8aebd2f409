"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: adapters at run time.

vLLM's routes, added only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or
``CHASSIS_ALLOW_RUNTIME_LORA_UPDATING``) is true (without it they do not exist: 404). A load
checks the adapter against the model before serving it (400 with the reason; 400 for a name
already served or the served model's name) and answers ``200`` with vLLM's plain-text
``Success: ...``; an unload removes the name (404 for an unknown one, as vLLM) and lets
requests that run with it finish. The routes take the API key like every other route.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from chassis.serve import errors
from chassis.serve.lora import AdapterNameError, UnknownAdapterError
from chassis.serve.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from chassis.serve.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Serve the adapter at ``lora_path`` as ``lora_name`` from now on."""
    state = _state(request)
    try:
        lora = await state.loras.load(body.lora_name, body.lora_path)
    except AdapterNameError as exc:
        raise errors.bad_request(str(exc), "lora_name") from None
    except ValueError as exc:
        raise errors.bad_request(str(exc), "lora_path") from None
    logger.info(
        "loaded LoRA adapter %r (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path
    )
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    """Stop serving ``lora_name`` (requests already running with it finish)."""
    state = _state(request)
    try:
        lora = state.loras.remove(body.lora_name)
    except UnknownAdapterError as exc:
        raise errors.APIError(404, str(exc), param="lora_name", code="model_not_found") from None
    logger.info("unloaded LoRA adapter %r (id %d)", lora.lora_name, lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")
