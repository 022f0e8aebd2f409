"""Kimi K2's tool calls (registered as ``kimi_k2``, as in vLLM)::

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>

A section opened by ``<|tool_calls_section_begin|>`` holds calls, each
``<|tool_call_begin|>``, the call's id, ``<|tool_call_argument_begin|>`` and its arguments as a
JSON object, up to ``<|tool_call_end|>``; the section ends at ``<|tool_calls_section_end|>``.
As in vLLM, the singular spellings ``<|tool_call_section_begin|>`` and
``<|tool_call_section_end|>`` are read too, and whitespace around the id and the arguments is
allowed. The id is ``functions.NAME:IDX`` (or ``NAME:IDX``): the function's name is what
follows the last ``.`` before the ``:``, and the id, kept as the call's id, is what Kimi's chat
template expects back in the ``tool`` messages.

The rest is ``deepseek_v3``'s reading (:mod:`~chassis.builtin_plugins.parsers.deepseek_v3`):
text around the section is content (vLLM drops what follows the section in a whole message;
here it is kept); a call not written so is content, as written, and the section read on; a
section without a call is content; text after the calls that opens no call ends the section.
Arguments are re-written as canonical JSON and stream once the id, the argument marker and
``{`` are written; committed arguments that stop being JSON get the rest of the call's text, up
to the next marker, as written. The markers are special tokens: the server keeps them.
"""

from __future__ import annotations

import re

from chassis.builtin_plugins.parsers.deepseek_v3 import DeepSeekV3ToolParser

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
#: the singular spellings vLLM accepts too
SECTION_BEGIN_SINGULAR = "<|tool_call_section_begin|>"
SECTION_END_SINGULAR = "<|tool_call_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

#: a call's head after its begin marker: the id (``functions.NAME:IDX``), the argument
#: marker, up to the "{" of the arguments
_HEAD = re.compile(
    r"[ \t\r\n]*([^\s<>]+:[0-9]+)[ \t\r\n]*" + re.escape(ARGUMENT_BEGIN) + r"[ \t\r\n]*(?=\{)"
)


def name_of_call_id(call_id: str) -> str:
    """The function's name in a Kimi call id: ``functions.get_weather:0`` → ``get_weather``."""
    return call_id.split(":")[0].split(".")[-1]


class KimiK2ToolParser(DeepSeekV3ToolParser):
    """``<|tool_calls_section_begin|>`` sections of ``<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>`` calls."""

    start_tag = SECTION_BEGIN
    start_tag_variants = (SECTION_BEGIN_SINGULAR,)
    section_ends = (SECTION_END, SECTION_END_SINGULAR)
    call_begin = CALL_BEGIN
    call_end = CALL_END
    head = _HEAD
    raw_ends = ()

    def call_name(self, head: re.Match[str]) -> tuple[str, str | None] | None:
        call_id = head.group(1)
        name = name_of_call_id(call_id)
        return (name, call_id) if name else None
