"""``LoRARequest``: the adapter a request runs with (vLLM's class of the same name)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, kw_only=False):
    """A LoRA adapter by name, number and location.

    :param lora_name: what clients call it (the API's ``model`` field selects it by name)
    :param lora_int_id: a number >= 1 that identifies the adapter in the engine: requests
        with the same id share its device slot and their prefix-cache entries; two different
        adapters must not share an id
    :param lora_path: a local folder in PEFT's format (``adapter_config.json`` and
        ``adapter_model.safetensors``, or an older PEFT's ``adapter_model.bin``)
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or not 1 <= self.lora_int_id < 2**63
        ):
            raise ValueError(
                f"LoRARequest.lora_int_id must be an integer >= 1; got {self.lora_int_id!r} "
                "(0 means 'no adapter' inside the engine)"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("LoRARequest.lora_path must be a folder path")
