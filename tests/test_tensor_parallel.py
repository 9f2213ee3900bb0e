"""Tensor parallelism (tokenfab/distributed) with 2 local CPU ranks on a tiny random Llama, adding their
partial sums through shared memory (the default here) or gloo: the same greedy tokens as one process,
shards that add up to the whole model, clear errors, no orphan processes."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.oracle import make_tiny_model
from tokenfab import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 4000, 99, 12], list(range(100, 160)), [7] * 20, list(range(100, 140)) + [3, 4]]
ENGINE = dict(max_model_len=256, num_kv_blocks=64, kernel_autotune=False, max_num_batched_tokens=32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", str(folder), bundled_tokenizer)      # 4 heads, 2 KV heads, MLP 128
    return str(folder)


@pytest.fixture(scope="module")
def restore_threads():
    before = torch.get_num_threads()      # rank 0 splits the cores between ranks for its process
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tp2(tiny_llama, restore_threads):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE)
    yield llm
    procs = list(llm.engine.runner.workers.procs)
    llm.close()
    assert not any(p.is_alive() for p in procs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_tp2_greedy_tokens_equal_tp1_batched_chunked_and_prefix_hits(tiny_llama, tp2):
    one = LLM(tiny_llama, **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    got = [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, GREEDY)]
    assert got == want
    # again: the shared prefixes now hit the prefix cache on every rank alike
    again = [o.outputs[0].token_ids for o in tp2.generate(PROMPTS[::-1], GREEDY)]
    assert again == want[::-1]
    assert tp2.engine.block_manager.prefix_hits > 0
    assert tp2.engine.block_manager.num_used_blocks() == 0
    assert tp2.engine.runner.allreduce == "shm"      # auto, for local processes on x86-64
    comm = tp2.engine.runner.comm       # two all-reduces per layer per step, on rank 0
    assert comm.calls > 0 and comm.calls % (2 * tp2.engine.model_config.num_layers) == 0


def test_tp2_over_gloo_gives_the_same_greedy_tokens_as_tp1(tiny_llama, restore_threads):
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **ENGINE).generate(PROMPTS, GREEDY)]
    llm = LLM(tiny_llama, tensor_parallel_size=2, tp_allreduce="gloo", **ENGINE)
    try:
        assert llm.engine.runner.allreduce == "gloo"
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.close()


def test_link_calibrated_from_the_engines_all_reduces_is_what_the_planner_then_uses(tp2, tiny_llama, tmp_path):
    # the calibration hook (benchmarks/tensor_parallel.py --save-hardware): per-step all-reduce counter
    # deltas -> a latency + bandwidth fit -> a hardware entry the planner reads back
    from tokenfab.plan import comm as link
    from tokenfab.plan import roofline
    from tokenfab.plan.hardware import get_hardware, load_catalog, save_entry
    from tokenfab.plan.models import resolve_model
    c, deltas, last = tp2.engine.runner.comm, [], []

    def observe(shapes, start, end, busy):
        now = (c.calls, c.bytes, c.seconds)
        deltas.append(tuple(a - b for a, b in zip(now, last[-1])))
        last.append(now)
    last.append((c.calls, c.bytes, c.seconds))
    tp2.engine.step_observer = observe
    try:
        tp2.generate(PROMPTS, GREEDY)
    finally:
        tp2.engine.step_observer = None
    layers = tp2.engine.model_config.num_layers
    assert deltas and all(d[0] == 2 * layers for d in deltas)          # two all-reduces per layer per step
    samples = link.step_samples(deltas)
    assert {b for b, _ in samples} >= {4.0 * tp2.engine.model_config.hidden_size * len(PROMPTS)}   # a decode step
    fit = link.fit_allreduce(samples)
    assert fit.latency_us >= 0 and fit.gb_s > 0 and fit.samples == len(samples)
    base = get_hardware("dev-vm-2core", load_catalog(include_user=False))
    path = save_entry(tmp_path / "hw.yaml", "calibrated-cpu", {**base.to_entry(), **fit.entry()})
    hw = get_hardware("calibrated-cpu", load_catalog([str(path)], include_user=False))
    dep = roofline.Deployment.make(resolve_model(tiny_llama), hw, "fp32", act_dtype="fp32", tp=2)
    for nbytes, _ in samples:
        assert roofline.allreduce_s(dep, nbytes) == pytest.approx(
            link.allreduce_s(2, nbytes, fit.latency_us, fit.gb_s), rel=1e-3)      # entry rounds to 0.01 µs


def test_each_rank_holds_its_share_of_heads_and_kv_pool(tp2):
    full = tp2.engine.model_config
    shard = tp2.engine.model.config
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == \
        (full.num_heads // 2, full.num_kv_heads // 2, full.intermediate_size // 2)
    assert tp2.engine.runner.kv.shape[-2] == full.num_kv_heads // 2


def test_ranks_launch_as_ray_actors_inside_a_ray_actor_and_as_local_processes_elsewhere():
    from tokenfab.config import EngineConfig
    from tokenfab.distributed.executor import choose_launcher, in_ray_actor
    auto = EngineConfig(tensor_parallel_size=2)
    assert choose_launcher(auto, inside_ray_actor=True) == "ray"
    assert choose_launcher(auto, inside_ray_actor=False) == "mp"
    assert not in_ray_actor()                 # this test process is no Ray actor (Ray started or not)
    assert choose_launcher(auto) == "mp"
    for forced in ("mp", "ray"):              # distributed_executor_backend wins either way
        cfg = EngineConfig(tensor_parallel_size=2, distributed_executor_backend=forced)
        assert choose_launcher(cfg, inside_ray_actor=True) == choose_launcher(cfg, inside_ray_actor=False) == forced
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="slurm").validate()


def test_sharded_weights_concatenate_to_the_full_weights(tmp_path, bundled_tokenizer):
    # qwen2: q/k/v biases are sharded too
    make_tiny_model("qwen2", str(tmp_path), bundled_tokenizer)
    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.load import build_model
    files = load_model_files(str(tmp_path))
    full = build_model(files, torch.float32, "cpu", 16, 64, "none")
    ranks = [build_model(files, torch.float32, "cpu", 16, 64, "none", tp=(r, 2)) for r in range(2)]
    cfg = files.config
    d = cfg.head_dim
    for i, layer in enumerate(full.layers):
        a, m = layer.self_attn, layer.mlp
        parts = [(s.layers[i].self_attn, s.layers[i].mlp) for s in ranks]
        q_size, kv_size = parts[0][0].q_size, parts[0][0].kv_size
        for attr in ("weight", "bias"):
            fused = [getattr(pa.qkv_proj, attr) for pa, _ in parts]
            q = torch.cat([f[:q_size] for f in fused])
            k = torch.cat([f[q_size:q_size + kv_size] for f in fused])
            v = torch.cat([f[q_size + kv_size:] for f in fused])
            assert torch.equal(torch.cat([q, k, v]), getattr(a.qkv_proj, attr))
        assert q_size == cfg.num_heads // 2 * d and kv_size == cfg.num_kv_heads // 2 * d
        assert torch.equal(torch.cat([pa.o_proj.linear.weight for pa, _ in parts], dim=1), a.o_proj.weight)
        inter = parts[0][1].inter
        gate = torch.cat([pm.gate_up_proj.weight[:inter] for _, pm in parts])
        up = torch.cat([pm.gate_up_proj.weight[inter:] for _, pm in parts])
        assert torch.equal(torch.cat([gate, up]), m.gate_up_proj.weight)
        assert torch.equal(torch.cat([pm.down_proj.linear.weight for _, pm in parts], dim=1), m.down_proj.weight)
    for s in ranks:     # replicated
        assert torch.equal(s.embed_tokens.weight, full.embed_tokens.weight)
        assert torch.equal(s.lm_head.weight, full.lm_head.weight)


def test_tp_size_that_does_not_divide_the_heads_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LLM(tiny_llama, tensor_parallel_size=3, **ENGINE)


@pytest.mark.parametrize("heads,kv,inter,size,names", [(12, 4, 96, 3, "4 KV heads"), (4, 2, 90, 4, "90 MLP")])
def test_kv_heads_and_mlp_width_that_do_not_split_are_clear_errors(heads, kv, inter, size, names):
    from types import SimpleNamespace
    from tokenfab.distributed.shard import check_divisible
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv, intermediate_size=inter, num_experts=0)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {size} does not divide the model's {names}"):
        check_divisible(cfg, size)
    check_divisible(SimpleNamespace(num_heads=8, num_kv_heads=1, intermediate_size=64, num_experts=0), 4)   # KV replicated


def test_fewer_kv_heads_than_ranks_are_replicated_to_their_query_heads(tmp_path, bundled_tokenizer, monkeypatch):
    from tests import oracle
    monkeypatch.setitem(oracle.TINY_CONFIGS, "llama-mqa", dict(oracle.TINY_CONFIGS["llama"], num_key_value_heads=1))
    make_tiny_model("llama-mqa", str(tmp_path), bundled_tokenizer)
    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.load import build_model
    files = load_model_files(str(tmp_path))
    full = build_model(files, torch.float32, "cpu", 16, 64, "none")
    for r in range(2):
        a = build_model(files, torch.float32, "cpu", 16, 64, "none", tp=(r, 2)).layers[0].self_attn
        assert (a.h, a.kvh) == (2, 1)
        f = full.layers[0].self_attn
        assert torch.equal(a.qkv_proj.weight[a.q_size:], f.qkv_proj.weight[f.q_size:])       # the one K/V head
        assert torch.equal(a.qkv_proj.weight[:a.q_size], f.qkv_proj.weight[r * a.q_size:(r + 1) * a.q_size])


def test_cli_bad_tp_size_exits_non_zero_with_the_numbers(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "tokenfab", "generate", "--model", tiny_llama, "--tensor-parallel-size", "3",
                        "--max-tokens", "2", "--no-kernel-autotune", "hello"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert "does not divide the model's 4 attention heads" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("allreduce", ["shm", "gloo"])
def test_killed_worker_fails_the_step_clearly_and_stops_the_group(tiny_llama, restore_threads, allreduce):
    llm = LLM(tiny_llama, tensor_parallel_size=2, tp_allreduce=allreduce, **ENGINE)
    proc = llm.engine.runner.workers.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(RuntimeError, match="tensor-parallel group stopped"):
        llm.generate(PROMPTS[:2], GREEDY)
    assert llm.engine.block_manager.num_used_blocks() == 0     # the requests were aborted
    with pytest.raises(RuntimeError, match="must be recreated"):   # and it stays failed, no hang
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()
    assert not proc.is_alive() and llm.engine.model.tp_comm.group is None


def test_worker_killed_while_rank0_waits_in_the_shm_all_reduce_is_an_error_not_a_hang(tiny_llama, restore_threads):
    llm = LLM(tiny_llama, tensor_parallel_size=2, tp_allreduce="shm", **ENGINE)
    proc = llm.engine.runner.workers.procs[0]
    group = llm.engine.model.tp_comm.group
    real = group.all_reduce

    def kill_then_reduce(y):        # the step has reached the worker; it dies mid-step
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        return real(y)
    group.all_reduce = kill_then_reduce
    with pytest.raises(RuntimeError, match=rf"tensor-parallel group stopped: .*rank 1 \(pid {proc.pid}\) exited"):
        llm.generate(PROMPTS[:2], GREEDY)
    assert llm.engine.block_manager.num_used_blocks() == 0
    llm.close()


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_is_killed(tiny_llama):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from tokenfab import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({tiny_llama!r}, tensor_parallel_size=2, max_model_len=64, num_kv_blocks=16,
                      kernel_autotune=False)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
            print(" ".join(str(p.pid) for p in llm.engine.runner.workers.procs), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = os.path.join(os.path.dirname(tiny_llama), "tp_parent.py")
    with open(path, "w") as f:
        f.write(script)
    # the script lives outside the checkout: put the checkout on its path, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    pids = [int(p) for p in r.stdout.split()]
    assert pids
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a worker rank outlived its engine process"


@pytest.mark.slow
def test_rank0_forward_error_stops_the_workers_and_keeps_failing_clearly(tiny_llama, restore_threads, monkeypatch):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner.workers.procs)

    def broken(*a, **k):
        raise MemoryError("simulated failure in rank 0's forward")
    monkeypatch.setattr(llm.engine.model, "forward", broken)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="simulated failure"):
        llm.generate(PROMPTS[:2], GREEDY)
    assert time.monotonic() - t0 < 30            # workers waiting in an all-reduce are not waited for
    assert not any(p.is_alive() for p in procs)
    assert llm.engine.block_manager.num_used_blocks() == 0
    with pytest.raises(RuntimeError, match="must be recreated"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind,extra", [("qwen2", {"kv_cache_dtype": "int8"}), ("qwen3", {}), ("llama-mqa", {}),
                                        ("llama", {"quantization": "int8", "attention_backend": "torch"})])
def test_tp2_greedy_tokens_equal_tp1_other_families_and_options(kind, extra, tmp_path, bundled_tokenizer,
                                                                restore_threads, monkeypatch):
    from tests import oracle      # llama-mqa: one KV head, replicated on both ranks
    monkeypatch.setitem(oracle.TINY_CONFIGS, "llama-mqa", dict(oracle.TINY_CONFIGS["llama"], num_key_value_heads=1))
    make_tiny_model(kind, str(tmp_path), bundled_tokenizer)
    kw = {**ENGINE, **extra}
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **kw).generate(PROMPTS, GREEDY)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **kw)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert llm.engine.block_manager.num_used_blocks() == 0
    finally:
        llm.close()


@pytest.mark.slow
def test_tp2_gemma3_sliding_window_one_kv_head_equals_tp1(tmp_path, bundled_tokenizer, restore_threads):
    # Gemma 3: sandwich norms around the all-reduced outputs, GeGLU, q/k norms, a window of 16 slid past,
    # and its single KV head replicated on both ranks
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                           sliding_window=16, query_pre_attn_scalar=24, max_position_embeddings=1024,
                           initializer_range=0.2, bos_token_id=bundled_tokenizer.bos_token_id,
                           eos_token_id=bundled_tokenizer.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(tmp_path))
    bundled_tokenizer.save_pretrained(str(tmp_path))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **ENGINE).generate(PROMPTS, params)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    finally:
        llm.close()
