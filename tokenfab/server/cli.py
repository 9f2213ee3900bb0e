"""`tokenfab serve [MODEL]`: the OpenAI-compatible HTTP server.

Registering the parser imports neither torch nor FastAPI; the handler does, once it runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from tokenfab.engine_args import add_engine_args, parse_size

API_KEY_ENV = "TOKENFAB_API_KEY"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /metrics, ...). With no MODEL, the bundled SmolLM2-135M-Instruct.")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 exposes the server to the network (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /tokenize (repeat for several keys; "
                        f"also read from ${API_KEY_ENV})")
    g.add_argument("--api-keys-file", default=None, metavar="FILE.json",
                   help='API keys with per-key limits: {"keys": [{"key": ..., "name": ..., "requests_per_minute": '
                        '..., "tokens_per_minute": ..., "max_tokens": ..., "models": [...], "service_classes": [...]}]} '
                        "(docs/serving.md)")
    g.add_argument("--auth-all-routes", action="store_true",
                   help="require the key on /metrics, /version, /doctor and the web page too (not /health)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients may ask for (default: the model file's name)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="sequences allowed to wait for a slot; beyond it requests get 429 (default: 1024)")
    g.add_argument("--max-body-bytes", type=parse_size, default=16 << 20,
                   help="largest request body accepted, e.g. 16MiB; larger ones get 413 (default: 16MiB)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="enable CORS for these browser origins (default: no CORS)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish after SIGTERM (default: 30)")
    g.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log one line per request")
    g.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the web page (chat, live dashboard, bench viewer, doctor) at /")
    g.add_argument("--max-n", type=int, default=128,
                   help="most choices (n, best_of) one request may ask for; more get 400 (default: 128, OpenAI's)")
    g.add_argument("--max-request-sequences", type=int, default=1024,
                   help="most sequences (prompts x n) one request may start; more get 400 (default: 1024)")
    g.add_argument("--step-log", metavar="FILE.jsonl",
                   help="append one JSON line per engine step (shape and wall time): a measured step table for "
                        "`tokenfab plan capacity --step-table` and `plan validate`")
    g.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="interactive time-to-first-token target: a request predicted to miss it gets 429 "
                        "slo_unattainable with Retry-After at once (batch-class requests wait) (default: none)")
    g.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="interactive time-per-output-token target, enforced the same way (default: none)")
    g.add_argument("--batch-priority", type=_int_or_none, default=1, metavar="N|none",
                   help="a request whose priority is at least N (vLLM's convention: larger is less urgent) and "
                        "whose service_tier is auto or unset runs in the batch class; none: priority never picks "
                        "the class (default: 1)")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how tool calls are written and parsed (vLLM's flag): "
                        f"{', '.join(sorted(_tool_parsers()))} (default: chosen by the chat template; hermes)")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a thinking model's reasoning (<think>...</think>) out of the answer into "
                        f"reasoning_content and thinking blocks (vLLM's flag): {', '.join(sorted(_reasoning_parsers()))} "
                        "(default: none, the whole text is the answer)")
    b = p.add_argument_group("batch API (/v1/files, /v1/batches; docs/batch.md)")
    b.add_argument("--data-dir", metavar="DIR",
                   help="keep batch files and jobs here (SQLite + files); a restarted server resumes unfinished "
                        "batches (default: a temporary dir, deleted on exit)")
    b.add_argument("--batch-max-file-bytes", type=parse_size, default=200 << 20,
                   help="largest file POST /v1/files accepts, e.g. 200MiB (default: 200MiB)")
    b.add_argument("--batch-max-total-bytes", type=parse_size, default=10 << 30,
                   help="all stored files together, e.g. 10GiB (default: 10GiB)")
    b.add_argument("--batch-concurrency", type=int, default=None, metavar="N",
                   help="batch lines in the engine at once (default: --max-num-seqs)")
    r = p.add_argument_group("replicas on Ray Serve (pip install 'tokenfab[ray]'; docs/scale_out.md)")
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas as Ray Serve deployment replicas behind this server (default: one "
                        "engine in this process; Ray is not used)")
    r.add_argument("--long-replicas", type=int, default=0, metavar="M",
                   help="with --replicas: M more replicas that take only prompts of at least "
                        "--long-prompt-threshold tokens (default: 0, no long pool)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. HEAD_IP:6379, started with `ray start --head`) "
                        "(default: start a local one)")
    r.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs each replica declares to Ray; its engine runs that many threads (default: 1)")
    r.add_argument("--replica-memory", type=parse_size, default=None, metavar="SIZE",
                   help="memory each replica declares to Ray, e.g. 4GiB (default: 2GiB)")
    r.add_argument("--routing", choices=("prefix-affinity", "least-loaded"), default="prefix-affinity",
                   help="how a pool picks a replica: the prompt's first KV blocks' preferred replica (under a load "
                        "bound), else the least loaded; or always the least loaded (default: prefix-affinity)")
    r.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="serve flags from a YAML or JSON file (e.g. from `tokenfab tune`; flags given here "
                        "win), or a Ray Serve config to run its pools (e.g. from `tokenfab plan capacity "
                        "--emit serve-config`) instead of --replicas")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level (default: info)")
    p.set_defaults(func=serve_command, config_parser=p,
                   config_defaults=lambda path: _flag_defaults(p, path))


def _flag_defaults(parser: argparse.ArgumentParser, path: str) -> dict | None:
    from tokenfab.server.config_file import flag_defaults
    return flag_defaults(parser, path)


def server_config_from_args(args: argparse.Namespace):
    from tokenfab.server.config import ServerConfig
    keys = list(args.api_key or [])
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    policies = []
    if getattr(args, "api_keys_file", None):
        from tokenfab.server.keys import load_keys_file
        policies = load_keys_file(args.api_keys_file)
    config = ServerConfig(host=args.host, port=args.port, api_keys=keys, key_policies=policies,
                          auth_all_routes=getattr(args, "auth_all_routes", False),
                          served_model_names=list(args.served_model_name or []),
                          max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
                          allowed_origins=list(args.allowed_origins or []), shutdown_timeout=args.shutdown_timeout,
                          access_log=args.access_log,
                          max_n=args.max_n, max_request_sequences=args.max_request_sequences,
                          ui=args.ui, data_dir=args.data_dir, batch_max_file_bytes=args.batch_max_file_bytes,
                          batch_max_total_bytes=args.batch_max_total_bytes, batch_concurrency=args.batch_concurrency,
                          slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          batch_priority=args.batch_priority)
    config.validate()
    return config


def _int_or_none(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


def _tool_parsers() -> dict:
    from tokenfab.server.tool_parsers import PARSERS
    return PARSERS


def _reasoning_parsers() -> dict:
    from tokenfab.server.reasoning import PARSERS
    return PARSERS


def apply_slo_to_step_budget(engine_config, server_config) -> None:
    """--slo-tpot-ms is the step-time budget's limit unless --step-time-budget-ms says otherwise: batch work
    and long prompts then fill each step up to the interactive TPOT target (engine/step_budget.py)."""
    if engine_config.step_time_budget_ms is None and server_config.slo_tpot_ms is not None:
        engine_config.step_time_budget_ms = server_config.slo_tpot_ms


def serve_command(args: argparse.Namespace) -> int:
    from tokenfab.engine_args import engine_config_from_args
    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args)
    apply_slo_to_step_budget(engine_config, server_config)
    step_log = None
    if args.step_log:                   # opened before the slow model load, so a bad path fails fast
        from tokenfab.cli_errors import CLIError
        from tokenfab.costmodel.measured import StepLog
        try:
            step_log = StepLog(args.step_log)
        except OSError as e:
            raise CLIError(f"--step-log {args.step_log}: {e.strerror}") from None
    if server_config.data_dir:          # a corrupt or foreign batch.sqlite stops the start here, before the model loads
        from tokenfab.batch.store import BatchStore
        from tokenfab.cli_errors import CLIError
        try:
            BatchStore(server_config.data_dir, server_config.batch_max_file_bytes,
                       server_config.batch_max_total_bytes).close()
        except OSError as e:
            raise CLIError(f"--data-dir {server_config.data_dir}: {e.strerror or e}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    log = logging.getLogger("tokenfab.server")
    if server_config.host not in ("127.0.0.1", "localhost", "::1") and not (server_config.api_keys or server_config.key_policies):
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                    server_config.host)

    if args.replicas is None and not args.config and (args.long_replicas or args.ray_address):
        raise ValueError("--long-replicas and --ray-address need --replicas N (or --config FILE)")
    from tokenfab.server.launch import bind_socket, curl_example, make_server
    sock = bind_socket(server_config.host, server_config.port)   # fail fast, before the model loads
    spec = None
    if args.replicas is not None or args.config:      # only then is Ray imported (docs/scale_out.md)
        from tokenfab.serve_ray.deploy import start_from_args
        engine, spec = start_from_args(args, engine_config, server_config)
    else:
        engine = _load_engine(engine_config)
        engine.step_observer = step_log
    if spec is not None:
        from tokenfab.server.ingress import ingress_app
        app = ingress_app(engine, server_config)
    else:
        from tokenfab.server.app import build_app
        app = build_app(engine, server_config)
    state = app.state.tokenfab

    def ready(url: str) -> None:
        env = API_KEY_ENV if server_config.api_keys or server_config.key_policies else None
        print(f"\ntokenfab is serving {state.model_name} at {url} (max_model_len {state.max_model_len}). "
              f"Try:\n\n{curl_example(url, state.model_name, env)}\n", flush=True)
        if server_config.ui:
            print(f"Or open {url}/ in a browser (chat, live dashboard, bench viewer, doctor).\n", flush=True)
        if env and not os.environ.get(API_KEY_ENV):
            print(f"(set {API_KEY_ENV} to your key first, or paste it in place of ${API_KEY_ENV})\n", flush=True)

    try:
        make_server(app, server_config.shutdown_timeout, on_ready=ready).run(sockets=[sock])
    finally:
        if step_log is not None:
            step_log.close()
        if spec is not None:
            from tokenfab.serve_ray.deploy import stop_pools
            stop_pools(spec)
    return 0


def _load_engine(config):
    from tokenfab.engine.engine import LLMEngine
    if not sys.stderr.isatty():
        return LLMEngine(config)
    from rich.console import Console
    with Console(stderr=True).status(f"loading {config.model or 'the bundled SmolLM2-135M-Instruct'} ..."):
        return LLMEngine(config)
