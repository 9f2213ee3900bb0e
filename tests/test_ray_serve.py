"""`tokenfab serve --replicas`: engine replicas on a local Ray Serve cluster behind the usual server.

The cluster (started once for the module): a main pool of 2 replicas and a long pool of 1 (prompts of
at least LONG tokens), 1 CPU each, a small KV pool, the bundled model. Where Ray cannot start, the
tests skip with the reason. The default run keeps one end-to-end test (openai client, greedy output
equal to one engine in this process); routing, faults and recovery are slow tests.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional extra tokenfab[ray] (pip install 'tokenfab[ray]')")

from tokenfab.serve_ray import routing  # noqa: E402

LONG = 200                   # long-pool threshold, in prompt tokens
# float32 weights, as the test session's bundled_llm (the single-process reference, shared with other files)
ENGINE = dict(num_kv_blocks=96, max_model_len=1024, max_num_seqs=4, quantization="none")


def _slow_tests_selected(config) -> bool:
    return "not slow" not in (config.getoption("markexpr") or "")


@pytest.fixture(scope="module")
def cluster(request):
    from tokenfab.config import EngineConfig
    from tokenfab.server.config import ServerConfig
    from tokenfab.server.launch import ServerThread
    from tokenfab.serve_ray.deploy import start_pools, stop_pools
    from tokenfab.serve_spec import PoolSpec, ServeSpec
    from tokenfab.server.ingress import ingress_app

    try:
        # 3 logical CPUs for the pools, 1 more for the slow tensor-parallel replica (2 ranks x 0.5)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                 object_store_memory=256 << 20)
    except Exception as e:                      # no /dev/shm, no ports, a sandbox: say so, don't fail
        pytest.skip(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}")
    pools = [PoolSpec(routing.SHORT_POOL, 2, num_cpus=1, memory=1 << 30)]
    if _slow_tests_selected(request.config):     # the long pool only for the slow tests: one model load less
        pools.append(PoolSpec(routing.LONG_POOL, 1, num_cpus=1, memory=1 << 30))
    spec = ServeSpec(pools, long_prompt_threshold=LONG if len(pools) > 1 else None)
    try:
        engine = start_pools(EngineConfig(**ENGINE), spec)
        app = ingress_app(engine, ServerConfig(ui=False, access_log=False))
        with ServerThread(app) as server:
            yield SimpleNamespace(url=server.url, engine=engine, model=app.state.tokenfab.model_name)

            def idle() -> bool:                 # every request finished or aborted: no replica holds a block
                reps = [s for pool in engine.replica_stats().values() for s in pool.values()]
                return reps and all(s.get("num_running") == 0 and s.get("num_waiting") == 0
                                    and s.get("kv_cache_usage") == 0 for s in reps)
            _wait(idle, 30, "every replica to hold no request and no KV block")
    finally:
        stop_pools(spec)


def _decisions(pool: str | None = None) -> dict[tuple[str, str, str], int]:
    return {k: v for k, v in routing.DECISIONS.snapshot().items() if pool is None or k[0] == pool}


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _wait(pred, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


# -- no cluster needed ------------------------------------------------------------------------------
def test_plain_serve_never_imports_ray():
    # `tokenfab serve` without --replicas, up to loading the model (flags parsed, port bound)
    code = """
import sys
import tokenfab.server.cli as cli
class Loading(Exception):
    pass
def load(config):
    import tokenfab.server.app, tokenfab.server.launch    # what the rest of the command imports
    print("ray imported:", "ray" in sys.modules, flush=True)
    raise Loading()
cli._load_engine = load
from tokenfab.cli import main
try:
    main(["serve", "--port", "0", "--log-level", "error"])
except Loading:
    pass
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "ray imported: False" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_a_replica_that_dies_mid_request_is_replica_lost_and_before_its_text_engine_dead():
    from ray.exceptions import RayActorError

    from tokenfab.engine.client import EngineDeadError, ReplicaLost
    from tokenfab.serve_ray.pool import _as_engine_error

    assert isinstance(_as_engine_error(RayActorError(), "r1", started=True), ReplicaLost)   # 503, Retry-After
    assert isinstance(_as_engine_error(RayActorError(), "r1", started=False), EngineDeadError)


def test_prefix_affinity_is_stable_and_bounded_by_load():
    loads = [routing.ReplicaLoad("a"), routing.ReplicaLoad("b"), routing.ReplicaLoad("c")]
    key = routing.prefix_key(list(range(100)), 16)
    assert key == routing.prefix_key(list(range(64)) + [7, 7, 7], 16)      # only the first 4 blocks count
    assert routing.prefix_key(list(range(15)), 16) is None
    first, reason = routing.rank(loads, key)
    assert reason == routing.AFFINITY
    # the preferred replica overloaded beyond the bound: the prefix spills to another, counted as such
    hot = [routing.ReplicaLoad(r.replica, in_flight=20 if r.replica == first[0] else 0) for r in loads]
    spilled, reason = routing.rank(hot, key)
    assert reason == routing.SPILL and spilled[0] != first[0]
    # no key: least loaded
    order, reason = routing.rank([routing.ReplicaLoad("a", waiting=3), routing.ReplicaLoad("b", kv_usage=0.1)], None)
    assert (order[0], reason) == ("b", routing.LEAST_LOADED)
    # a replica leaving moves only the prefixes it held
    keys = [routing.prefix_key([i] * 16, 16) for i in range(200)]
    before = {k: routing.rendezvous_order(k, ["a", "b", "c"])[0] for k in keys}
    after = {k: routing.rendezvous_order(k, ["a", "b"])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")


def test_emitted_serve_config_loads(tmp_path):
    from tokenfab.cli import main
    from tokenfab.serve_spec import spec_from_config
    path = tmp_path / "serve.yaml"
    assert main(["plan", "capacity", "--hardware", "rtx-3090", "--rate", "20", "--num-requests", "100",
                 "--emit", "serve-config", str(path)]) == 0
    spec = spec_from_config(str(path))           # validated by Ray's own ServeDeploySchema on the way
    (pool,) = spec.pools
    auto = pool.autoscaling_config
    assert pool.name == routing.SHORT_POOL and auto["min_replicas"] == 1
    assert auto["max_replicas"] >= 1 and auto["target_ongoing_requests"] >= 1
    assert main(["plan", "capacity", "--hardware", "rtx-3090", "--rate", "20", "--num-requests", "50",
                 "--emit", "k8s", str(path)]) == 2


@pytest.mark.parametrize("argv, says", [
    (["--long-replicas", "1"], "need --replicas"),
    (["--replicas", "0"], "at least 1"),
    (["--replicas", "1", "--long-replicas", "1"], "--long-prompt-threshold"),
    (["--config", "/nonexistent/serve.yaml"], "No such file"),
    (["--replicas", "1", "--slo-ttft-ms", "500"], "not available with --replicas"),
])
def test_replica_flags_misused_get_a_message_not_a_cluster(argv, says, capsys):
    from tokenfab.cli import main
    assert main(["serve", "--port", "0", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_config_that_is_not_ray_serve_is_refused(tmp_path):
    from tokenfab.serve_spec import spec_from_config
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n- name: x\n  import_path: other.module:app\n")
    with pytest.raises(ValueError, match="tokenfab runs only"):
        spec_from_config(str(bad))
    bad.write_text("applications: 3\n")
    with pytest.raises(ValueError, match="not a valid Ray Serve config"):
        spec_from_config(str(bad))


# -- on the cluster ---------------------------------------------------------------------------------
def test_openai_client_through_the_ingress_matches_one_engine(cluster, bundled_llm):
    from openai import OpenAI
    from tokenfab import SamplingParams
    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = ["The capital of France is", "List three colors:"]
    got = [client.completions.create(model=cluster.model, prompt=p, max_tokens=16, temperature=0).choices[0].text
           for p in prompts]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=cluster.model, prompt=prompts[0], max_tokens=16, temperature=0, stream=True))
    chat = client.chat.completions.create(model=cluster.model, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=12, temperature=0)
    llm = bundled_llm
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0),
                                                    use_tqdm=False)]
    want_chat = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=12, temperature=0),
                         use_tqdm=False)[0].outputs[0].text
    assert got == want
    assert streamed == want[0]
    assert chat.choices[0].message.content == want_chat
    assert httpx.get(cluster.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'tokenfab:router_decisions_total{' in metrics and 'pool="main"' in metrics
    assert metrics.count("tokenfab:replica_num_requests_running{") == len(cluster.engine.handles) + 1  # by replica


@pytest.mark.slow
def test_same_prefix_goes_to_one_replica_whose_prefix_cache_hits(cluster):
    prefix = [(i * 37) % 5000 + 100 for i in range(96)]                       # 6 full blocks
    before = _decisions(routing.SHORT_POOL)
    for i in range(6):
        r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                       json={"prompt": prefix + [200 + i, 300 + i], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    moved = _delta(before, _decisions(routing.SHORT_POOL))
    assert sum(moved.values()) == 6
    assert {(reason) for _, reason, _ in moved} == {routing.AFFINITY}
    (replica,) = {rep for _, _, rep in moved}

    def hits():
        s = cluster.engine.replica_stats()[routing.SHORT_POOL].get(replica, {})
        return s.get("prefix_cache_hits", 0) >= 5 * 64
    _wait(hits, 15, f"replica {replica}'s prefix-cache hits to rise")
    assert f'replica="{replica}"' in httpx.get(cluster.url + "/metrics").text


@pytest.mark.slow
def test_long_prompts_land_in_the_long_pool(cluster):
    before = _decisions()
    for n in (LONG + 10, 20, LONG):
        r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                       json={"prompt": [100 + i % 3000 for i in range(n)], "max_tokens": 2})
        assert r.status_code == 200, r.text
    moved = _delta(before, _decisions())
    by_pool = {p: sum(v for (pp, _, _), v in moved.items() if pp == p) for p in (routing.SHORT_POOL, routing.LONG_POOL)}
    assert by_pool == {routing.SHORT_POOL: 1, routing.LONG_POOL: 2}


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], started: asyncio.Event) -> dict:
    """One streaming request: whether a token arrived, and how it ended (done / error event)."""
    got_token, ended = False, None
    async with client.stream("POST", url + "/v1/completions",
                             json={"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True,
                                   "ignore_eos": True}) as r:
        if r.status_code != 200:
            return {"token": False, "end": f"http {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                ended = ended or "done"
                break
            event = json.loads(data)
            if "error" in event:
                ended = "error: " + event["error"]["message"]
            elif event["choices"] and event["choices"][0]["text"]:
                got_token = True
                started.set()
    return {"token": got_token, "end": ended}


def _replica_actor(pool: str, replica: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        if name.endswith(f"#{replica}") and f"tokenfab-{pool}#" in name:
            return ray.get_actor(name, namespace=entry.get("namespace", "serve") if isinstance(entry, dict) else "serve")
    raise AssertionError(f"no actor for replica {replica}")


@pytest.mark.slow
def test_killed_replica_loses_no_request_and_comes_back(cluster):
    engine = cluster.engine
    main_before = set(engine.replica_stats()[routing.SHORT_POOL])
    long_before = set(engine.replica_stats()[routing.LONG_POOL])
    assert len(main_before) == 2 and len(long_before) == 1

    decisions, seen = _decisions(routing.SHORT_POOL), {}

    async def load() -> list[dict]:
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as client:
            # 12 requests on 2 replicas of max_num_seqs 4: some run, some wait in the engines' queues
            tasks = [asyncio.create_task(_stream(client, cluster.url, [1000 + i, 7, 8, 9], started))
                     for i in range(12)]
            await asyncio.wait_for(started.wait(), 120)
            routed = _delta(decisions, _decisions(routing.SHORT_POOL))
            victim = max(main_before, key=lambda r: sum(v for (_, _, rep), v in routed.items() if rep == r))
            seen.update(victim=victim, routed=routed, stats=engine.replica_stats()[routing.SHORT_POOL])
            ray.kill(_replica_actor(routing.SHORT_POOL, victim), no_restart=True)
            late = [asyncio.create_task(_stream(client, cluster.url, [2000 + i, 7, 8], asyncio.Event()))
                    for i in range(4)]                              # arrive while the replica is gone
            return await asyncio.wait_for(asyncio.gather(*tasks, *late), 280)

    retries_before = engine.retries
    results = asyncio.run(load())
    errors = [r for r in results if r["end"] and r["end"].startswith("error")]
    assert all(r["end"] == "done" or r in errors for r in results), results     # every request ended
    # the kill hit something: streams under way ended with an error event, or un-started ones were re-sent
    assert len(errors) + engine.retries - retries_before >= 1, (results, seen)
    # a stream with no token yet had not started: it was retried, so it completed
    assert all(r["end"] == "done" for r in results if not r["token"]), results
    assert len(errors) <= 4, results                        # at most the killed replica's running set

    # the long pool's only replica: /health says degraded until Ray has replaced it
    ray.kill(_replica_actor(routing.LONG_POOL, next(iter(long_before))), no_restart=True)
    _wait(lambda: httpx.get(cluster.url + "/health").json()["status"] == "degraded", 60, "/health degraded")
    _wait(lambda: len(engine.replica_stats()[routing.SHORT_POOL]) == 2
          and len(engine.replica_stats()[routing.LONG_POOL]) == 1
          and httpx.get(cluster.url + "/health").json()["status"] == "ok", 240, "the replicas to come back")
    assert set(engine.replica_stats()[routing.SHORT_POOL]) != main_before
    r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                   json={"prompt": [100 + i for i in range(LONG)], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_tensor_parallel_replica_runs_its_ranks_as_ray_actors_and_matches_one_engine(cluster, tmp_path_factory,
                                                                                    bundled_tokenizer):
    # (last in the file: it adds an application to the module's cluster and then deletes it)
    # `serve --replicas 1 --tensor-parallel-size 2` on a tiny random Llama: rank 1 is a Ray actor that
    # declares the replica's resources; greedy output through the same ingress equals one process
    from ray import serve
    from tests.oracle import make_tiny_model
    from tokenfab import LLM, SamplingParams
    from tokenfab.server.config import ServerConfig
    from tokenfab.server.launch import ServerThread
    from tokenfab.serve_ray.deploy import _deployment
    from tokenfab.serve_spec import PoolSpec
    from tokenfab.server.ingress import ingress_app
    from tokenfab.serve_ray.pool import ReplicaPoolEngine
    folder = str(tmp_path_factory.mktemp("tiny-llama-tp"))
    make_tiny_model("llama", folder, bundled_tokenizer)          # 4 heads, 2 KV heads: splits in two
    engine = dict(model=folder, tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64,
                  kernel_autotune=False, quantization="none")
    prompts = [[5, 17, 300, 4000, 99, 12], list(range(100, 160))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(folder, **{k: v for k, v in engine.items() if k not in ("model",
            "tensor_parallel_size")}).generate(prompts, params, use_tqdm=False)]
    free = ray.available_resources().get("CPU", 0)
    routers_before = routing.routers(routing.SHORT_POOL)
    pool = PoolSpec(routing.SHORT_POOL, 1, num_cpus=0.5, memory=512 << 20)
    handle = serve.run(_deployment(pool, engine, None), name="tokenfab-tp-test", route_prefix=None)
    try:
        # rank 0 (the replica) and rank 1 (its actor) hold 0.5 CPU each
        _wait(lambda: free - ray.available_resources().get("CPU", 0) >= 1.0 - 1e-6, 30,
              "the replica and its worker rank to hold 1 CPU together")
        pool_engine = ReplicaPoolEngine({routing.SHORT_POOL: handle}, handle.describe.remote().result())
        app = ingress_app(pool_engine, ServerConfig(ui=False, access_log=False))
        with ServerThread(app) as server:
            got = [httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": app.state.tokenfab.model_name, "prompt": p, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True}).json()["choices"][0]["text"] for p in prompts]
        assert got == want
    finally:
        serve.delete("tokenfab-tp-test")
        for r in routing.routers(routing.SHORT_POOL):       # its router: out of the cluster's pool stats
            if r not in routers_before:
                routing.unregister_router(routing.SHORT_POOL, r)
    # the worker rank died with its replica: its CPU is free again
    _wait(lambda: ray.available_resources().get("CPU", 0) >= free - 1e-6, 60, "the worker rank to go with its replica")
