"""Formats that are ``hermes``'s with other tags (:mod:`~chassis.builtin_plugins.parsers.
hermes`): JSON calls in tagged blocks, text around them content. vLLM's names:

- ``jamba`` (AI21 Jamba 1.5+): ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]
  </tool_calls>``, a JSON list of calls in one block;
- ``internlm`` (InternLM2/2.5 chat): ``<|action_start|><|plugin|>\\n{"name": ...,
  "parameters": {...}}<|action_end|>``;
- ``granite-20b-fc`` (granite-20b-functioncalling): ``<function_call> {"name": ...,
  "arguments": {...}}`` once per call, with no end tag: a call's block ends at the next
  ``<function_call>`` or the message's end (a ``</function_call>``, which the model does not
  write, would end it too); text after a streamed call's JSON object in its block is
  dropped, as vLLM's reading ignores it.

Everything else is ``hermes``'s reading: a block whose JSON is not a call (or calls) is
content as written; calls written as one object stream once ``{"name": "...", "arguments":
{`` (or ``"parameters"``) is written, a list of calls is read whole when its block ends.
Unlike vLLM's ``internlm``, which reads only the first call, every block is read.
"""

from __future__ import annotations

from chassis.builtin_plugins.parsers.hermes import HermesToolParser


class JambaToolParser(HermesToolParser):
    """``<tool_calls>[...]</tool_calls>`` (Jamba's tags are special tokens)."""

    needs_special_tokens = True
    start_tag = "<tool_calls>"
    end_tag = "</tool_calls>"


class InternLMToolParser(HermesToolParser):
    """``<|action_start|><|plugin|>{...}<|action_end|>`` (special tokens of InternLM2's
    tokenizer)."""

    needs_special_tokens = True
    start_tag = "<|action_start|><|plugin|>"
    end_tag = "<|action_end|>"


class Granite20bFCToolParser(HermesToolParser):
    """``<function_call> {...}`` blocks, each ending at the next one (plain-text tags)."""

    start_tag = "<function_call>"
    end_tag = "</function_call>"
