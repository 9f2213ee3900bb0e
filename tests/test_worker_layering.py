"""The worker side stays below the engine core: neither worker/ nor distributed/ imports tokenfab.engine
(lazy imports inside functions included), and tensor parallelism builds from a copy of the config."""
import ast
from pathlib import Path

import tokenfab
from tokenfab.config import EngineConfig

PACKAGE = Path(tokenfab.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_worker_and_distributed_never_import_the_engine_core():
    offenders = [f"{p.relative_to(PACKAGE)}: {m}" for part in ("worker", "distributed")
                 for p in sorted((PACKAGE / part).glob("*.py")) for m in sorted(_imported_modules(p))
                 if m == "tokenfab.engine" or m.startswith("tokenfab.engine.")]
    assert offenders == []


def test_tensor_parallel_rank_config_is_a_copy_and_leaves_the_callers_config_alone():
    from tokenfab.distributed.executor import rank_config
    config = EngineConfig(tensor_parallel_size=2, tp_allreduce="gloo", enable_fused_decode=True)
    rank = rank_config(config)
    assert rank is not config and not rank.enable_fused_decode
    assert config.enable_fused_decode and rank.tensor_parallel_size == 2
