"""The front end (server/, batch/, serve_ray/) talks to the engine through EngineClient (engine/client.py)
and nothing inside it: no scheduler, block manager, runner or KV pool reached from the event loop, and
no engine module imported beyond the client's own parts. Checked on the source (every import counts,
lazy ones too), so it runs in milliseconds."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenfab.engine.client import EngineClient, EngineStats, ModelInfo

PACKAGE = Path(__file__).resolve().parent.parent / "tokenfab"
FRONT_END = ("server", "batch", "serve_ray")
# Engine state the front end must not reach into (attributes, or getattr(..., "name")).
INTERNALS = {"scheduler", "block_manager", "runner", "kv", "model_config", "step_cost"}
# The engine modules any front-end file may import: the protocol, its request streams, the lane policy
# (service classes), and grammar compilation (the input side: a bad schema is a 400 before queueing).
ALLOWED = {"tokenfab.engine.client", "tokenfab.engine.streams", "tokenfab.engine.lanes",
           "tokenfab.engine.structured"}
# Where an engine is built and handed over (composition, not use): these may import what they build.
HOSTS = {"server/app.py": {"tokenfab.engine.async_engine"},        # wraps an LLMEngine in an AsyncEngine
         "server/cli.py": {"tokenfab.engine.engine"},              # `tokenfab serve` loads the model
         "server/batch_cli.py": {"tokenfab.engine.engine"},        # `tokenfab batch run` loads the model
         "serve_ray/replica.py": {"tokenfab.engine.async_engine", "tokenfab.engine.engine"}}   # one replica's engine


def front_end_files() -> list[Path]:
    return sorted(p for part in FRONT_END for p in (PACKAGE / part).glob("*.py"))


def engine_imports(tree: ast.AST) -> set[str]:
    def is_engine(name: str) -> bool:
        return name == "tokenfab.engine" or name.startswith("tokenfab.engine.")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and is_engine(node.module):
            found |= {node.module} if node.module != "tokenfab.engine" else {f"tokenfab.engine.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if is_engine(a.name)}
    return found


def internal_reaches(tree: ast.AST, engine_attr: bool = True) -> list[str]:
    """`engine_attr`: also flag `.engine` (a client's engine object; serve_ray's PoolSpec.engine is a
    dict of settings, so serve_ray is scanned without it)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif engine_attr and isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"line {node.lineno}: .engine (the client's engine object)")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in INTERNALS):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


@pytest.mark.parametrize("path", front_end_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_front_end_reaches_the_engine_only_through_its_client(path: Path):
    rel = str(path.relative_to(PACKAGE))
    tree = ast.parse(path.read_text(), filename=str(path))
    assert internal_reaches(tree, engine_attr=not rel.startswith("serve_ray/")) == [], f"{rel} reaches into the engine; use EngineClient (engine/client.py)"
    extra = engine_imports(tree) - ALLOWED - HOSTS.get(rel, set())
    assert not extra, f"{rel} imports {sorted(extra)}; the front end imports engine/client.py and its parts only"


def test_the_scan_catches_what_it_looks_for():
    src = ("def f(st):\n    st.client.engine.scheduler.running\n    getattr(x, 'kv', None)\n"
           "    from tokenfab.engine.kv_cache import BlockManager\n")
    tree = ast.parse(src)
    assert len(internal_reaches(tree)) == 3
    assert engine_imports(tree) == {"tokenfab.engine.kv_cache"}


def test_the_client_module_imports_no_engine_core():
    code = ("import sys, tokenfab.engine.client, tokenfab.engine.streams; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('tokenfab.engine.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert eval(out) == ["tokenfab.engine.client", "tokenfab.engine.lanes", "tokenfab.engine.streams"]


def _fake_engine():
    stats = EngineStats(0, 0, 0.0, 8, 0, 0, 0, 0, 0)
    return SimpleNamespace(tokenizer=None, model_config=SimpleNamespace(vocab_size=100), max_model_len=64,
                           model_path=None, config=SimpleNamespace(max_num_seqs=4, scheduling_policy="fcfs",
                                                                   max_num_batched_tokens=512,
                                                                   batch_prefill_share=0.25,
                                                                   long_prompt_threshold=1000),
                           stats=lambda: stats)


def test_both_engines_the_server_runs_on_implement_the_client():
    from tokenfab.engine.async_engine import AsyncEngine
    from tokenfab.serve_ray.pool import ReplicaPoolEngine
    local = AsyncEngine(_fake_engine())
    pools = ReplicaPoolEngine({}, {"info": local.info, "tokenizer": None})
    for client in (local, pools):
        assert isinstance(client, EngineClient), type(client).__name__
        assert client.info.vocab_size == 100 and client.info.max_model_len == 64
    assert pools.tokenize([1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="not in"):
        pools.tokenize([100])


def test_lane_settings_come_from_the_lanes_module_once():
    from tokenfab.engine.async_engine import model_info
    from tokenfab.engine.lanes import PrefillCaps, batch_prefill_cap
    info = model_info(_fake_engine())
    assert info.batch_prefill_cap == batch_prefill_cap(512, 0.25) == 128
    assert PrefillCaps.for_step(512, 0.25, None, None).batch_left == info.batch_prefill_cap
    assert batch_prefill_cap(512, 1.0) is None and batch_prefill_cap(2, 0.1) == 1
    assert info.is_long_prompt(1000) and not info.is_long_prompt(999)
    assert not ModelInfo(None, 64, 100).is_long_prompt(10**6)          # no long lane
