"""tokenfab: run LLMs fast under concurrent load, measure them, and plan hardware for them.

The offline API mirrors vLLM's: ``from tokenfab import LLM, SamplingParams``.
"""
__version__ = "0.1.0"

from tokenfab.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from tokenfab.llm import LLM
        return LLM
    raise AttributeError(name)
