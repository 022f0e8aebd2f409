"""Built-in model architectures, registered through ``chassis.general_plugins``."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl

_PKG = "chassis.builtin_plugins.models"


@hookimpl
def chassis_register_models(registry: Any) -> None:
    # Lazy strings: nothing is imported until a model of that architecture is built.
    registry.register("LlamaForCausalLM", f"{_PKG}.llama:LlamaForCausalLM")
    registry.register("MistralForCausalLM", f"{_PKG}.llama:LlamaForCausalLM")
    registry.register("Qwen2ForCausalLM", f"{_PKG}.qwen2:Qwen2ForCausalLM")
    registry.register("Qwen3ForCausalLM", f"{_PKG}.qwen3:Qwen3ForCausalLM")
    # sequence classifiers (and cross-encoder rerankers): pooling engines only
    registry.register(
        "LlamaForSequenceClassification", f"{_PKG}.llama:LlamaForSequenceClassification"
    )
    registry.register(
        "Qwen2ForSequenceClassification", f"{_PKG}.qwen2:Qwen2ForSequenceClassification"
    )
    registry.register(
        "Qwen3ForSequenceClassification", f"{_PKG}.qwen3:Qwen3ForSequenceClassification"
    )
    # BERT-family encoders (embeddings) and their cross-encoders: pooling engines only
    registry.register("BertModel", f"{_PKG}.bert:BertModel")
    registry.register("RobertaModel", f"{_PKG}.bert:RobertaModel")
    registry.register("XLMRobertaModel", f"{_PKG}.bert:RobertaModel")
    registry.register("BertForSequenceClassification", f"{_PKG}.bert:BertForSequenceClassification")
    registry.register(
        "RobertaForSequenceClassification", f"{_PKG}.bert:RobertaForSequenceClassification"
    )
    registry.register(
        "XLMRobertaForSequenceClassification", f"{_PKG}.bert:RobertaForSequenceClassification"
    )
    # more encoders: ModernBERT (and its classifiers), EmbeddingGemma (a bidirectional
    # Gemma3TextModel)
    registry.register("ModernBertModel", f"{_PKG}.modernbert:ModernBertModel")
    registry.register(
        "ModernBertForSequenceClassification",
        f"{_PKG}.modernbert:ModernBertForSequenceClassification",
    )
    registry.register("Gemma3TextModel", f"{_PKG}.embedding_gemma:EmbeddingGemmaModel")
    # decoder embedding models saved as the bare decoder (no LM head): pooling engines only
    registry.register("LlamaModel", f"{_PKG}.decoder_embedding:LlamaEmbeddingModel")
    registry.register("MistralModel", f"{_PKG}.decoder_embedding:LlamaEmbeddingModel")
    registry.register("Qwen2Model", f"{_PKG}.decoder_embedding:Qwen2EmbeddingModel")
    registry.register("Qwen3Model", f"{_PKG}.decoder_embedding:Qwen3EmbeddingModel")
    registry.register("Gemma2Model", f"{_PKG}.decoder_embedding:Gemma2EmbeddingModel")
    registry.register("MixtralForCausalLM", f"{_PKG}.mixtral:MixtralForCausalLM")
    registry.register("Qwen2MoeForCausalLM", f"{_PKG}.qwen2_moe:Qwen2MoeForCausalLM")
    registry.register("Qwen3MoeForCausalLM", f"{_PKG}.qwen3_moe:Qwen3MoeForCausalLM")
    registry.register("GemmaForCausalLM", f"{_PKG}.gemma:GemmaForCausalLM")
    registry.register("Gemma2ForCausalLM", f"{_PKG}.gemma2:Gemma2ForCausalLM")
    registry.register("Gemma3ForCausalLM", f"{_PKG}.gemma3:Gemma3ForCausalLM")
    # multimodal Gemma 3, with images (SigLIP tower, bidirectional image attention)
    registry.register(
        "Gemma3ForConditionalGeneration",
        f"{_PKG}.gemma3_images:Gemma3ForConditionalGenerationWithImages",
    )
    # Mistral 3: the Mistral / Ministral 3 decoder, with images (Pixtral tower)
    registry.register(
        "Mistral3ForConditionalGeneration",
        f"{_PKG}.mistral3_images:Mistral3ForConditionalGenerationWithImages",
    )
    # more multimodal checkpoints (their language model; the Qwen VL ones take images)
    registry.register(
        "Qwen2VLForConditionalGeneration", f"{_PKG}.qwen2_vl:Qwen2VLForConditionalGeneration"
    )
    registry.register(
        "Qwen2_5_VLForConditionalGeneration", f"{_PKG}.qwen2_vl:Qwen2VLForConditionalGeneration"
    )
    registry.register(
        "Qwen3VLForConditionalGeneration", f"{_PKG}.qwen3_vl:Qwen3VLForConditionalGeneration"
    )
    registry.register(
        "Qwen3VLMoeForConditionalGeneration",
        f"{_PKG}.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
    )
    # LLaVA-1.5: the text config's registered decoder, with images (CLIP / SigLIP towers)
    registry.register(
        "LlavaForConditionalGeneration",
        f"{_PKG}.llava_images:LlavaForConditionalGenerationWithImages",
    )
    # LLaVA-NeXT: as LLaVA-1.5, with its anyres tiles and image_newline
    registry.register(
        "LlavaNextForConditionalGeneration",
        f"{_PKG}.llava_next_images:LlavaNextForConditionalGenerationWithImages",
    )
    # LLaVA-OneVision: as LLaVA-NeXT, with its grid cap and multi-image packing (Qwen2 text)
    registry.register(
        "LlavaOnevisionForConditionalGeneration",
        f"{_PKG}.llava_onevision_images:LlavaOnevisionForConditionalGenerationWithImages",
    )
    # InternVL (-hf): as LLaVA-1.5, with the InternViT tower, pixel shuffle and tiles
    registry.register(
        "InternVLForConditionalGeneration",
        f"{_PKG}.internvl_images:InternVLForConditionalGenerationWithImages",
    )
    # Aya Vision: as LLaVA-1.5, with a SigLIP tower, pixel shuffle, SwiGLU projector and tiles
    registry.register(
        "AyaVisionForConditionalGeneration",
        f"{_PKG}.aya_vision_images:AyaVisionForConditionalGenerationWithImages",
    )
    # Idefics3 / SmolVLM: as LLaVA-1.5, with their SigLIP-like tower, pixel shuffle and tiles
    registry.register(
        "Idefics3ForConditionalGeneration",
        f"{_PKG}.idefics3_images:Idefics3ForConditionalGenerationWithImages",
    )
    # SmolVLM2: Idefics3's model, with videos (a run of one-tile frames)
    registry.register(
        "SmolVLMForConditionalGeneration",
        f"{_PKG}.smolvlm:SmolVLMForConditionalGenerationWithImages",
    )
    # Qwen2-Audio: the Qwen2 decoder, with audio (Whisper-style tower, linear projector)
    registry.register(
        "Qwen2AudioForConditionalGeneration",
        f"{_PKG}.qwen2_audio:Qwen2AudioForConditionalGenerationWithAudio",
    )
    # Whisper: an encoder-decoder speech recognizer (cross K/V in per-request state slots)
    registry.register(
        "WhisperForConditionalGeneration", f"{_PKG}.whisper:WhisperForConditionalGeneration"
    )
    # GLM-4.1V / GLM-4.5V: the GLM-4 / GLM-4.5 decoder, with images (Qwen VL's image path)
    registry.register(
        "Glm4vForConditionalGeneration", f"{_PKG}.glm4v:Glm4vForConditionalGeneration"
    )
    registry.register(
        "Glm4vMoeForConditionalGeneration", f"{_PKG}.glm4v:Glm4vMoeForConditionalGeneration"
    )
    registry.register("Ministral3ForCausalLM", f"{_PKG}.ministral3:Ministral3ForCausalLM")
    registry.register("Phi3ForCausalLM", f"{_PKG}.phi3:Phi3ForCausalLM")
    registry.register("Olmo2ForCausalLM", f"{_PKG}.olmo2:Olmo2ForCausalLM")
    registry.register("Olmo3ForCausalLM", f"{_PKG}.olmo3:Olmo3ForCausalLM")
    registry.register("OlmoeForCausalLM", f"{_PKG}.olmoe:OlmoeForCausalLM")
    registry.register("Exaone4ForCausalLM", f"{_PKG}.exaone4:Exaone4ForCausalLM")
    registry.register("GraniteForCausalLM", f"{_PKG}.granite:GraniteForCausalLM")
    registry.register("GraniteMoeForCausalLM", f"{_PKG}.granitemoe:GraniteMoeForCausalLM")
    registry.register(
        "GraniteMoeSharedForCausalLM", f"{_PKG}.granitemoeshared:GraniteMoeSharedForCausalLM"
    )
    # state-space models (Mamba2 mixers) and hybrids: a recurrent state per request
    registry.register(
        "GraniteMoeHybridForCausalLM", f"{_PKG}.granitemoehybrid:GraniteMoeHybridForCausalLM"
    )
    registry.register("Mamba2ForCausalLM", f"{_PKG}.mamba2:Mamba2ForCausalLM")
    registry.register("MambaForCausalLM", f"{_PKG}.mamba:MambaForCausalLM")
    registry.register("FalconMambaForCausalLM", f"{_PKG}.mamba:FalconMambaForCausalLM")
    registry.register("JambaForCausalLM", f"{_PKG}.jamba:JambaForCausalLM")
    registry.register("BambaForCausalLM", f"{_PKG}.bamba:BambaForCausalLM")
    registry.register("NemotronHForCausalLM", f"{_PKG}.nemotron_h:NemotronHForCausalLM")
    registry.register("Qwen3NextForCausalLM", f"{_PKG}.qwen3_next:Qwen3NextForCausalLM")
    registry.register("Lfm2ForCausalLM", f"{_PKG}.lfm2:Lfm2ForCausalLM")
    registry.register("FalconH1ForCausalLM", f"{_PKG}.falcon_h1:FalconH1ForCausalLM")
    registry.register("GptOssForCausalLM", f"{_PKG}.gpt_oss:GptOssForCausalLM")
    registry.register("Glm4ForCausalLM", f"{_PKG}.glm4:Glm4ForCausalLM")
    registry.register("SeedOssForCausalLM", f"{_PKG}.seed_oss:SeedOssForCausalLM")
    registry.register("SmolLM3ForCausalLM", f"{_PKG}.smollm3:SmolLM3ForCausalLM")
    registry.register("Llama4ForCausalLM", f"{_PKG}.llama4:Llama4ForCausalLM")
    # Llama 4 Scout / Maverick: the Llama 4 decoder, with images (its tower and tiles)
    registry.register(
        "Llama4ForConditionalGeneration",
        f"{_PKG}.llama4_images:Llama4ForConditionalGenerationWithImages",
    )
    registry.register("ArceeForCausalLM", f"{_PKG}.arcee:ArceeForCausalLM")
    registry.register("Starcoder2ForCausalLM", f"{_PKG}.starcoder2:Starcoder2ForCausalLM")
    registry.register("Cohere2ForCausalLM", f"{_PKG}.cohere2:Cohere2ForCausalLM")
    registry.register("GPTNeoXForCausalLM", f"{_PKG}.gpt_neox:GPTNeoXForCausalLM")
    registry.register("PhiForCausalLM", f"{_PKG}.phi:PhiForCausalLM")
    registry.register("StableLmForCausalLM", f"{_PKG}.stablelm:StableLmForCausalLM")
    registry.register("GPTJForCausalLM", f"{_PKG}.gptj:GPTJForCausalLM")
    registry.register("DeepseekV2ForCausalLM", f"{_PKG}.deepseek_v2:DeepseekV2ForCausalLM")
    registry.register("DeepseekV3ForCausalLM", f"{_PKG}.deepseek_v3:DeepseekV3ForCausalLM")
    registry.register("Glm4MoeForCausalLM", f"{_PKG}.glm4_moe:Glm4MoeForCausalLM")
    registry.register("MiniMaxM2ForCausalLM", f"{_PKG}.minimax_m2:MiniMaxM2ForCausalLM")
    registry.register("Dots1ForCausalLM", f"{_PKG}.dots1:Dots1ForCausalLM")
    registry.register("Ernie4_5ForCausalLM", f"{_PKG}.ernie4_5:Ernie4_5ForCausalLM")
    registry.register("Ernie4_5_MoeForCausalLM", f"{_PKG}.ernie4_5_moe:Ernie4_5_MoeForCausalLM")
    registry.register("ApertusForCausalLM", f"{_PKG}.apertus:ApertusForCausalLM")
    registry.register(
        "HunYuanDenseV1ForCausalLM", f"{_PKG}.hunyuan_v1_dense:HunYuanDenseV1ForCausalLM"
    )
    registry.register("HunYuanMoEV1ForCausalLM", f"{_PKG}.hunyuan_v1_moe:HunYuanMoEV1ForCausalLM")
    # learned absolute positions instead of RoPE (vLLM's quickstart model is facebook/opt-125m)
    registry.register("OPTForCausalLM", f"{_PKG}.opt:OPTForCausalLM")
    registry.register("GPT2LMHeadModel", f"{_PKG}.gpt2:GPT2LMHeadModel")
    # an EAGLE-1 draft head over a target (--speculative-config method eagle), never alone
    registry.register("EagleLlamaForCausalLM", f"{_PKG}.llama_eagle:EagleLlamaHead")
    # an EAGLE-3 draft head (method eagle3): the published heads' name and vLLM's
    registry.register("LlamaForCausalLMEagle3", f"{_PKG}.llama_eagle3:Eagle3LlamaHead")
    registry.register("Eagle3LlamaForCausalLM", f"{_PKG}.llama_eagle3:Eagle3LlamaHead")
