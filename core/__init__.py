"""Engine core: config, requests, scheduling, KV cache, model execution, LLM and AsyncLLM."""
