"""Reference runtime: run GGUF models with their weights in quantized form (llama, deepseek2)."""
