"""tokenfab: run LLMs fast under concurrent load, measure them, and plan hardware for them.

The offline API mirrors vLLM's: ``from tokenfab import LLM, SamplingParams``.
"""
import os as _os

# OpenMP workers that finish a parallel region spin before they sleep: libgomp's default is 300,000
# spins (~20 ms at ~140 cycles a PAUSE on Sapphire Rapids). With other processes on the cores a
# spinning worker burns the time slice its descheduled peer needs to reach the barrier. 20,000 (~1 ms,
# like Intel OpenMP's KMP_BLOCKTIME=1) made two threads' collapse under two busy loops rarer, at the
# same quiet speed (docs/serving.md, "Shared cores"; runs in benchmarks/results/contention.md).
# libgomp reads it once, when torch loads it: set before torch is imported; a value already set wins.
_os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from tokenfab.sampling import SamplingParams
from tokenfab.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from tokenfab.llm import LLM
        return LLM
    raise AttributeError(name)
