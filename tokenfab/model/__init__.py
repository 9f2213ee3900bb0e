"""Model loading (GGUF and HF folders) and the Llama-family decoder."""
