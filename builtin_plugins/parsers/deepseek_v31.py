"""DeepSeek-V3.1's tool calls (registered as ``deepseek_v31``, as in vLLM)::

    Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3's section (:mod:`~chassis.builtin_plugins.parsers.deepseek_v3`) with V3.1's simpler calls:
``<｜tool▁call▁begin｜>``, the function's name, ``<｜tool▁sep｜>`` and the arguments as a bare
JSON object (no type before the name, no fence), up to ``<｜tool▁call▁end｜>``. As for V3: text
around the section is content; a call not written so (no name, arguments that are not a JSON
object) is content, as written, and the section read on; a section without a call is content;
text after the calls that opens no call ends the section. Arguments are sent as canonical
JSON as they are written, once ``NAME<｜tool▁sep｜>{`` is written; committed arguments that
stop being JSON get the rest of the call's text, up to the next marker, as written.
"""

from __future__ import annotations

import re

from chassis.builtin_plugins.parsers.deepseek_v3 import SEP, DeepSeekV3ToolParser

#: a call's head after its begin marker: the name, the separator, up to the "{" of the
#: arguments
_HEAD = re.compile(r"[ \t\r\n]*([^\s<>]+)[ \t\r\n]*" + re.escape(SEP) + r"[ \t\r\n]*(?=\{)")


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """``<｜tool▁calls▁begin｜>`` sections of ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
    <｜tool▁call▁end｜>`` calls."""

    head = _HEAD
    raw_ends = ()
