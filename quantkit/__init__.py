"""quantkit: per-tensor GGUF quantization recipes, byte-exact with llama.cpp / ik_llama.cpp."""
__version__ = "0.1.0"
