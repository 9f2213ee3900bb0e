"""The FastAPI app: routes, error handlers, middlewares, and the engine's life cycle.

    app = build_app(LLMEngine(EngineConfig()), ServerConfig())   # then run it with uvicorn

The generation routes live in completions.py, chat.py, messages.py (Anthropic's Messages API) and
responses.py (OpenAI's Responses API); the small ones are here. The routes reach the engine only through its EngineClient (engine/client.py); an
LLMEngine given here is wrapped in an AsyncEngine, whose worker thread starts with the app (lifespan)
and stops after uvicorn has drained the connections.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import tempfile

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.async_engine import AsyncEngine
from tokenfab.engine.client import EngineClient, ModelInfo
from tokenfab.batch.service import BatchService
from tokenfab.batch.store import BatchStore
from tokenfab.server import batch_routes, chat, completions, messages, responses
from tokenfab.server.batch_dispatch import call_route
from tokenfab.server.config import ServerConfig
from tokenfab.server.doctor_route import add_doctor_route
from tokenfab.server.errors import APIError, install_error_handlers
from tokenfab.server.keys import KeyPolicy
from tokenfab.server.metrics import CONTENT_TYPE, ServerMetrics
from tokenfab.server.middleware import AccessLog, APIKeyAuth, BodySizeLimit
from tokenfab.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenfab.server.openapi import install_openapi
from tokenfab.server.state import ServerState
from tokenfab.server.ui import add_ui_routes
from tokenfab.server.tokenizer_info import tokenizer_info
from tokenfab.version import __version__

log = logging.getLogger("tokenfab.server")


def default_model_name(info: ModelInfo) -> str:
    """The bundled model's name, or the file/folder name without a .gguf suffix."""
    from tokenfab.files.bundled import model_display_name
    return model_display_name(info.model_path)


def build_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine`: an EngineClient (an AsyncEngine, the Ray pools), or an LLMEngine to
    run in an AsyncEngine."""
    config = config or ServerConfig()
    config.validate()
    client = engine if isinstance(engine, EngineClient) else AsyncEngine(engine)
    client.max_waiting_requests = config.max_waiting_requests
    names = list(config.served_model_names) or [default_model_name(client.info)]
    metrics = ServerMetrics(client, names[0])
    client.listener = metrics
    state = ServerState(client, config, names, metrics)
    if config.slo_ttft_ms is not None or config.slo_tpot_ms is not None:
        _install_slo(state, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        with contextlib.ExitStack() as cleanup:
            data_dir = config.data_dir or cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tokenfab-batch-"))
            store = cleanup.enter_context(contextlib.closing(
                BatchStore(data_dir, config.batch_max_file_bytes, config.batch_max_total_bytes)))
            app.state.batches = BatchService(store, functools.partial(call_route, app), config.batch_concurrency or client.info.max_num_seqs)
            app.state.batches.resume()       # batches a previous run left unfinished carry on
            try:
                yield
            finally:
                state.draining = True
                await app.state.batches.stop()
                await client.stop()

    app = FastAPI(title="tokenfab", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tokenfab = state
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    batch_routes.install(app)
    _add_small_routes(app, state)
    add_doctor_route(app, state)
    if config.ui:
        add_ui_routes(app)
    install_openapi(app)

    # add_middleware wraps outside-in in reverse order of the calls: the last added runs first.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes,
                       path_limits={"/v1/files": config.batch_max_file_bytes + (64 << 10)})   # + multipart framing
    policies = [KeyPolicy(k, f"key-{i + 1}") for i, k in enumerate(config.api_keys)] + list(config.key_policies)
    if policies:
        metrics.key_policies = policies
        app.add_middleware(APIKeyAuth, policies=policies, limiter=metrics.key_limiter,
                           all_routes=config.auth_all_routes)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])
    app.add_middleware(AccessLog, enabled=config.access_log)
    return app


def _get_and_head(app: FastAPI, path: str):
    """A GET route that answers HEAD too (probes, and clients that check before they fetch). Two routes,
    not one with two methods, so each gets its own OpenAPI operation id."""
    def register(fn):
        app.head(path)(fn)
        return app.get(path)(fn)
    return register


def _install_slo(state: ServerState, config: ServerConfig) -> None:
    """Admission by predicted latency, from the load the engine publishes after each step (its step
    model learns from its own steps)."""
    from tokenfab.server.slo import Listeners, SloAdmission
    client = state.client
    client.load()                           # the engine publishes its load from now on
    ms = lambda v: None if v is None else v / 1e3                   # noqa: E731
    state.slo = SloAdmission(client.load, client.info.max_num_batched_tokens, ms(config.slo_ttft_ms),
                             ms(config.slo_tpot_ms))
    client.listener = Listeners(state.metrics, state.slo)
    state.metrics.registry.register(state.slo)


def _add_small_routes(app: FastAPI, st: ServerState) -> None:
    @_get_and_head(app, "/health")
    async def health() -> Response:
        if st.client.dead_reason is not None or not st.client.is_alive:
            reason = st.client.dead_reason or "the engine loop is not running"
            return APIError(503, f"unhealthy: {reason}", code="engine_dead").response()
        if st.draining:
            return APIError(503, "shutting down", code="shutting_down").response()
        reason = st.client.degraded()          # replica pools (serve_ray/pool.py): a pool without replicas
        if reason is not None:
            return JSONResponse({"status": "degraded", "reason": reason})
        return JSONResponse({"status": "ok"})

    @_get_and_head(app, "/version")
    async def version() -> dict:
        return {"version": __version__}

    @_get_and_head(app, "/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": st.created, "owned_by": "tokenfab",
             "root": st.info.model_path, "max_model_len": st.max_model_len}
            for name in st.model_names]}

    @_get_and_head(app, "/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        st.check_model(model_id)
        return {"id": model_id, "object": "model", "created": st.created, "owned_by": "tokenfab",
                "max_model_len": st.max_model_len}

    @_get_and_head(app, "/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    @_get_and_head(app, "/tokenizer_info")
    async def get_tokenizer_info() -> dict:
        return tokenizer_info(st.tokenizer, st.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req: TokenizeRequest = await st.parse(request, TokenizeRequest)
        st.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            ids = chat.conversation_ids(st, req.messages, req.add_generation_prompt,
                                           template_kwargs=req.chat_template_kwargs)
        else:
            ids = list(st.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
        return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req: DetokenizeRequest = await st.parse(request, DetokenizeRequest)
        st.check_model(req.model)
        vocab = st.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in [0, {vocab})", param="tokens", code="invalid_value")
        return {"prompt": st.tokenizer.decode(req.tokens)}
