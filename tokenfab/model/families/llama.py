"""Llama (2, 3.x: its RoPE scaling is model/rope.py's) and Mistral: the decoder as it is."""
from tokenfab.model.families import Family, register

register(Family("llama", ("llama",), rope_permuted=True))
register(Family("mistral", ("mistral",), rope_permuted=True))
