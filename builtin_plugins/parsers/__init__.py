"""Built-in tool-call and reasoning parsers, registered through ``chassis.general_plugins``
(``--tool-call-parser NAME``, ``--reasoning-parser NAME``; see docs/serving.md)."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl

_PKG = "chassis.builtin_plugins.parsers"


@hookimpl
def chassis_register_tool_parsers(registry: Any) -> None:
    registry.register("hermes", f"{_PKG}.hermes:HermesToolParser")
    registry.register("llama3_json", f"{_PKG}.llama3_json:Llama3JsonToolParser")
    registry.register("mistral", f"{_PKG}.mistral:MistralToolParser")
    registry.register("pythonic", f"{_PKG}.pythonic:PythonicToolParser")
    registry.register("qwen3_coder", f"{_PKG}.qwen3_coder:Qwen3CoderToolParser")
    registry.register("deepseek_v3", f"{_PKG}.deepseek_v3:DeepSeekV3ToolParser")
    registry.register("glm45", f"{_PKG}.glm45:Glm45ToolParser")
    registry.register("openai", f"{_PKG}.harmony_tools:HarmonyToolParser")
    registry.register("granite", f"{_PKG}.granite:GraniteToolParser")
    registry.register("seed_oss", f"{_PKG}.seed_oss:SeedOssToolParser")
    registry.register("kimi_k2", f"{_PKG}.kimi_k2:KimiK2ToolParser")
    registry.register("deepseek_v31", f"{_PKG}.deepseek_v31:DeepSeekV31ToolParser")
    registry.register("minimax_m2", f"{_PKG}.minimax_m2:MiniMaxM2ToolParser")
    registry.register("llama4_pythonic", f"{_PKG}.pythonic:Llama4PythonicToolParser")
    registry.register("phi4_mini_json", f"{_PKG}.phi4_mini:Phi4MiniJsonToolParser")
    registry.register("xlam", f"{_PKG}.xlam:XLamToolParser")
    registry.register("internlm", f"{_PKG}.hermes_variants:InternLMToolParser")
    registry.register("jamba", f"{_PKG}.hermes_variants:JambaToolParser")
    registry.register("granite-20b-fc", f"{_PKG}.hermes_variants:Granite20bFCToolParser")


@hookimpl
def chassis_register_reasoning_parsers(registry: Any) -> None:
    registry.register("qwen3", f"{_PKG}.think_tags:Qwen3ReasoningParser")
    registry.register("deepseek_r1", f"{_PKG}.think_tags:DeepSeekR1ReasoningParser")
    registry.register("openai_gptoss", f"{_PKG}.harmony_reasoning:HarmonyReasoningParser")
    registry.register("granite", f"{_PKG}.granite_reasoning:GraniteReasoningParser")
    registry.register("seed_oss", f"{_PKG}.think_tags:SeedOssReasoningParser")
    registry.register("deepseek_v3", f"{_PKG}.think_tags:DeepSeekV3ReasoningParser")
    registry.register("glm45", f"{_PKG}.think_tags:Glm45ReasoningParser")
    registry.register("olmo3", f"{_PKG}.think_tags:Olmo3ReasoningParser")
    registry.register("ernie45", f"{_PKG}.answer_tags:Ernie45ReasoningParser")
    registry.register("hunyuan_a13b", f"{_PKG}.answer_tags:HunyuanA13BReasoningParser")
    registry.register("minimax_m2", f"{_PKG}.think_tags:MiniMaxM2ReasoningParser")
    registry.register(
        "minimax_m2_append_think",
        f"{_PKG}.minimax_m2_reasoning:MiniMaxM2AppendThinkReasoningParser",
    )
    registry.register("mistral", f"{_PKG}.think_tags:MistralReasoningParser")
