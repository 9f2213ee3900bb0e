"""`tokenfab serve` flags and the real process: engine flags map onto EngineConfig, the server prints a
ready curl command, and SIGTERM drains an in-flight stream before a clean exit."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tokenfab.config import EngineConfig
from tokenfab.engine_args import add_engine_args, engine_config_from_args, parse_size


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_engine_flags_map_onto_engine_config_fields():
    cfg = engine_config_from_args(parse(
        ["m.gguf", "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
         "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "64MiB",
         "--dtype", "bfloat16",
         "--quantization", "int8", "--kv-cache-dtype", "int8", "--scheduling-policy", "priority", "--seed", "3"]))
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == \
        ("m.gguf", 512, 8, 256, 32)
    assert (cfg.enable_prefix_caching, cfg.kv_cache_memory_bytes, cfg.dtype, cfg.quantization) == \
        (False, 64 << 20, "bfloat16", "int8")
    assert (cfg.kv_cache_dtype, cfg.scheduling_policy, cfg.seed) == ("int8", "priority", 3)


def test_the_kv_pool_bytes_take_vllms_name_and_the_earlier_one():
    assert engine_config_from_args(parse(["--kv-cache-memory", "64MiB"])).kv_cache_memory_bytes == 64 << 20
    assert EngineConfig.from_kwargs(kv_cache_memory=1 << 20).kv_cache_memory_bytes == 1 << 20
    with pytest.raises(ValueError, match="earlier name of kv_cache_memory_bytes"):
        EngineConfig.from_kwargs(kv_cache_memory=1 << 20, kv_cache_memory_bytes=2 << 20)


def test_flags_left_out_keep_the_engine_config_defaults():
    assert engine_config_from_args(parse([])) == EngineConfig()


@pytest.mark.parametrize("text,want", [("1024", 1024), ("2KiB", 2048), ("1.5GB", 1_500_000_000), ("512mib", 512 << 20)])
def test_sizes_accept_units(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--kv-cache-memory-bytes", "lots"], ["--dtype", "int3"]])
def test_bad_engine_flags_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error" in capsys.readouterr().err


def test_registering_the_serve_command_does_not_import_torch():
    code = "import sys, tokenfab.cli as c; c.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_busy_port_fails_fast_with_a_clear_message():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tokenfab.cli", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr


@pytest.mark.slow
def test_serve_prints_curl_and_sigterm_drains_the_inflight_stream():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", "--port", "0", "--max-model-len", "512",
                             "--num-kv-blocks", "64", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stderr_lines: list[str] = []
    reader = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        banner = ""
        for line in proc.stdout:               # the ready banner, ending with the curl command's body
            banner += line
            if line.strip().startswith("-d "):
                break
        url = re.search(r"curl (http://\S+)/v1/chat/completions", banner).group(1)
        payload = json.loads(re.search(r"-d '(.*)'", banner).group(1))
        with httpx.Client(base_url=url, timeout=120) as c:
            assert c.post("/v1/chat/completions", json={**payload, "max_tokens": 2}).status_code == 200
            body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        reader.join(10)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
        log = "".join(stderr_lines)
        assert "draining 1 in-flight request" in log
        assert re.search(r'"POST /v1/completions" 200 id=cmpl-\w+ prompt_tokens=\d+ output_tokens=24 ttft_ms=', log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_command_may_redefine_an_engine_flag_after_adding_them():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parser.add_argument("--seed", dest="sampling_seed", type=int)    # as `generate` does
    args = parser.parse_args(["--seed", "5"])
    assert args.sampling_seed == 5
    assert engine_config_from_args(args).seed == EngineConfig().seed


def test_small_batch_threads_is_an_engine_option_off_by_default():
    assert engine_config_from_args(parse([])).small_batch_threads is None
    assert engine_config_from_args(parse(["--small-batch-threads", "3"])).small_batch_threads == 3
    with pytest.raises(ValueError, match="small_batch_threads must be 0"):
        engine_config_from_args(parse(["--small-batch-threads", "-1"]))


def test_unknown_tool_call_parser_is_a_clear_error_before_the_model_loads():
    r = subprocess.run([sys.executable, "-m", "tokenfab.cli", "serve", "--port", "0", "--tool-call-parser", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "unknown tool-call parser 'nope'; known: hermes" in r.stderr and "Traceback" not in r.stderr


def test_unknown_reasoning_parser_is_a_clear_error_listing_the_known_ones():
    r = subprocess.run([sys.executable, "-m", "tokenfab.cli", "serve", "--port", "0", "--reasoning-parser", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "unknown reasoning parser 'nope'; known: deepseek_r1, qwen3" in r.stderr and "Traceback" not in r.stderr
