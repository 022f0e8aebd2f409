"""Seed-OSS's tool calls (registered as ``seed_oss``, as in vLLM): Qwen3-Coder's XML-style
calls in ``<seed:tool_call>`` blocks::

    I'll look that up.
    <seed:tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </seed:tool_call>

Everything but the block's tags is ``qwen3_coder``'s
(:mod:`~chassis.builtin_plugins.parsers.qwen3_coder`), as vLLM's ``seed_oss`` parser is
Qwen3-Coder's with these tags: each ``<function=NAME>`` in a block is a call, each
``<parameter=KEY>`` an argument whose value (less one newline at each end) is converted by
the type the request's ``tools`` declare for it (undeclared and string parameters stay text,
``null`` is ``null``, integers, numbers, booleans, objects and arrays are read as such). Text
around the blocks is content, a block that does not start with ``<function=NAME>`` is
content as written, and a call cut short by the end of generation keeps what was written
(valid JSON). A block ends at ``</seed:tool_call>`` or the next ``<seed:tool_call>``.

Calls stream once ``<function=NAME>`` is written, parameter by parameter. Seed-OSS's
reasoning (``<seed:think>...</seed:think>``, the ``seed_oss`` reasoning parser) is split off
before this parser reads the content, so calls written inside the reasoning are not calls.
The tags are special tokens of Seed-OSS's tokenizer: the server keeps them in the text.
"""

from __future__ import annotations

from chassis.builtin_plugins.parsers.qwen3_coder import Qwen3CoderToolParser

START = "<seed:tool_call>"
END = "</seed:tool_call>"


class SeedOssToolParser(Qwen3CoderToolParser):
    """``<seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
    </seed:tool_call>``."""

    needs_special_tokens = True
    start_tag = START
    end_tag = END
