"""The names some EngineConfig fields accept, registered by the parts that implement them.

`config` sits below the parts that implement its names (quantization methods in quant/, attention
backends in model/, linear kernels in kernels/ and quant/), so it cannot import them to check a name.
Each part registers its names here when it is imported, and EngineConfig.validate checks a field
against what is registered:

    register("quantization", "auto", "none", "int8", ...)     # quant/load.py
    check("quantization", config.quantization)              # config.py

A field that no part has registered names for yet is not checked here: its part, once imported,
checks the name again where it resolves it (the engine imports them all before it validates).
"""
from __future__ import annotations

_NAMES: dict[str, dict[str, None]] = {}       # field -> its names, in registration order


def register(field: str, *names: str) -> None:
    _NAMES.setdefault(field, {}).update(dict.fromkeys(names))


def registered(field: str) -> tuple[str, ...]:
    return tuple(_NAMES.get(field, ()))


def check(field: str, value: str) -> None:
    """ValueError naming the registered names when `value` is not one of them."""
    names = _NAMES.get(field)
    if names and value not in names:
        raise ValueError(f"{field} must be one of {', '.join(names)}, got {value!r}")
