"""ServerState: what every route needs (engine client, config, metrics) and the steps they share.

The engine is reached only through its EngineClient (engine/client.py): tokenizing, grammar checks,
requests, and the stats and model info it publishes.
A generation request goes: parse the body -> check the model -> prompt token ids -> length check ->
SamplingParams -> `start` (queue in the engine, with load shedding) -> stream or `collect`.
Each step raises APIError with OpenAI's status and the field at fault; nothing is queued until
every prompt of the request has passed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tokenfab.engine.client import EngineClient, EngineDeadError, QueueFullError, RequestFailed
from tokenfab.engine.lanes import BATCH, service_class_of
from tokenfab.engine.streams import RequestStream
from tokenfab.outputs import RequestOutput
from tokenfab.sampling import SamplingParams
from tokenfab.server.config import ServerConfig
from tokenfab.server.errors import APIError, ClientGone, from_validation_errors, parse_json_object
from tokenfab.server.logprobs import TokenText
from tokenfab.server.metrics import ServerMetrics

log = logging.getLogger("tokenfab.server")


@dataclass
class ServerState:
    client: EngineClient
    config: ServerConfig
    model_names: list[str]
    metrics: ServerMetrics
    draining: bool = False
    slo: object | None = None                  # server/slo.py SloAdmission, with --slo-ttft-ms / --slo-tpot-ms
    created: int = field(default_factory=lambda: int(time.time()))
    _warned_fields: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.info = self.client.info
        self.tokenizer = self.client.tokenizer
        self.token_text = TokenText(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    # -- request checks --------------------------------------------------------------------------
    async def parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        obj = parse_json_object(await request.body())
        try:
            parsed = model.model_validate(obj)
        except ValidationError as e:
            raise from_validation_errors(e.errors()) from None
        key = request.scope.get("state", {}).get("api_key")
        if key is not None:
            self.check_key(key, parsed)
        extra = sorted(set(parsed.model_extra or ()) - self._warned_fields)
        if extra:
            self._warned_fields.update(extra)
            log.warning("ignoring request field(s) this server does not use: %s", ", ".join(extra))
        return parsed

    def check_key(self, key, req) -> None:
        """The request against its API key's policy (server/keys.py): the models and service classes it may
        use (403), its largest max_tokens (a larger one given is a 400; none given, the cap). `parse` runs
        it on every body; a route that maps its body onto another request (/v1/messages) runs it again
        on that one."""
        model = getattr(req, "model", None)
        if key.models is not None and model is not None and model not in key.models:
            raise APIError(403, f"the API key {key.name!r} may not use the model {model!r}; it may use "
                                f"{', '.join(repr(m) for m in key.models)}", param="model", code="model_not_allowed")
        if key.service_classes is not None and hasattr(req, "service_tier"):
            cls = service_class_of(req.service_tier, getattr(req, "priority", 0), self.config.batch_priority)
            if cls not in key.service_classes:
                raise APIError(403, f"the API key {key.name!r} may not send {cls!r} requests (service_tier / "
                                    f"priority); it may send {', '.join(key.service_classes)}",
                               param="service_tier", code="service_class_not_allowed")
        if key.max_tokens is not None and hasattr(req, "max_tokens"):
            given = [f for f in ("max_completion_tokens", "max_tokens") if f in req.model_fields_set
                     and getattr(req, f, None) is not None]
            for field_name in given:
                v = getattr(req, field_name)
                if v > key.max_tokens:
                    raise APIError(400, f"{field_name} is {v}; the API key {key.name!r} allows at most "
                                        f"{key.max_tokens}", param=field_name, code="max_tokens_over_key_limit")
            if not given:          # none given (or the API's default, completions' 16): the key's cap
                req.max_tokens = key.max_tokens

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(repr(m) for m in self.model_names)}", param="model",
                           code="model_not_found")

    def check_available(self) -> None:
        if self.client.dead_reason is not None:
            raise APIError(503, f"the engine has stopped ({self.client.dead_reason}); restart the server",
                           code="engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def check_supported(self, req) -> None:
        bad = req.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported")

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            return self.client.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_param: str, max_param: str) -> None:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise APIError(400, f"prompt has {num_prompt} tokens but max_model_len is {limit} (at least one "
                                "token must be left to generate); shorten the prompt",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens >= 1 and num_prompt + max_tokens > limit:
            raise APIError(400, f"prompt has {num_prompt} tokens and {max_param} asks for {max_tokens} more, "
                                f"but max_model_len is {limit}; set {max_param} to at most {limit - num_prompt}",
                           param=max_param, code="context_length_exceeded")

    def sampling_params(self, kwargs: dict, renames: dict[str, str] | None = None) -> SamplingParams:
        """SamplingParams, with its validation errors as 400s naming the request's field."""
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            msg = str(e)
            first = msg.split(" ", 1)[0].strip("(),")
            param = first if first in SamplingParams.__dataclass_fields__ else None
            if param and renames and param in renames:
                msg = msg.replace(param, renames[param], 1)
                param = renames[param]
            raise APIError(400, msg, param=param, code="invalid_value") from None

    def request_class(self, req) -> str:
        """The request's service class (engine/lanes.py service_class_of), with its priority checked:
        under FCFS a priority may only pick the batch class (at or above --batch-priority), since there
        is no order within a class to give it."""
        threshold = self.config.batch_priority
        cls = service_class_of(req.service_tier, req.priority, threshold)
        policy = self.info.scheduling_policy
        picks_class = threshold is not None and req.priority >= threshold
        if req.priority != 0 and policy != "priority" and not picks_class:
            raise APIError(400, "priority needs the server started with --scheduling-policy priority"
                           + (f" (or, to send it as batch work, at least {threshold})" if threshold is not None
                              and cls != BATCH else ""), param="priority", code="unsupported")
        return cls

    # -- running ---------------------------------------------------------------------------------
    async def start(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                    priority: int, arrival_time: float, service_class: str = "interactive") -> list[RequestStream]:
        """Queue one engine request per prompt (ids `request_id` or `request_id-i`); all or none."""
        self.check_available()
        if self.slo is not None:
            cached = 0 if params.prompt_logprobs is not None else self.client.cached_prompt_tokens(prompts, params.n)
            self.slo.admit(sum(map(len, prompts)) * params.n, service_class, cached)
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                if self.slo is not None:
                    self.slo.track([rid], service_class)     # before its first token can arrive
                streams.append(await self.client.add_request(rid, ids, params, priority, arrival_time,
                                                             service_class))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_dead") from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e), code="invalid_value") from None
            if isinstance(e, RequestFailed):
                raise APIError(500, str(e), code="engine_error") from None
            raise
        return streams

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Final outputs of every stream; a client that disconnects meanwhile aborts them all."""
        results = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
            if results in done:
                return results.result()
            raise ClientGone()
        except (RequestFailed, EngineDeadError) as e:
            raise APIError(500 if isinstance(e, RequestFailed) else 503, str(e), code="engine_error") from None
        finally:
            gone.cancel()
            if not results.done():
                results.cancel()
            for s in streams:
                s.abort()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone (the body was read already, so only disconnects arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
