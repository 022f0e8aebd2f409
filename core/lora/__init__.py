"""LoRA adapters: many fine-tunes of one base model served side by side (``--enable-lora``).

- :mod:`.request`: :class:`LoRARequest`, which adapter a request runs with;
- :mod:`.adapter`: reading PEFT adapter folders and checking them against the model;
- :mod:`.layers`: :class:`LoRALinear`, the wrapper that adds the adapters' deltas per token;
- :mod:`.model`: :class:`LoRAModel`, which wraps a model's linear layers and keeps the
  adapters of the running batch in device slots.

See docs/lora.md.
"""

from chassis.core.lora.request import LoRARequest

__all__ = ["LoRARequest"]
