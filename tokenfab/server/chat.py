"""POST /v1/chat/completions: messages through the model's chat template, streamed or not.

`max_completion_tokens` (or the older `max_tokens`) bounds the reply; unset, it may run to
max_model_len. `logprobs: true` with `top_logprobs: k` gives OpenAI's chat logprobs format.
`prepare` is the one place a chat request is checked and turned into a prompt and SamplingParams;
/v1/messages (server/messages.py) maps its body onto a chat request and runs it through `prepare` too.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.llm import chat_token_ids
from tokenfab.sampling import SamplingParams
from tokenfab.server.errors import APIError
from tokenfab.server.limits import check_request, logit_bias_ids
from tokenfab.server.logprobs import chat_logprobs
from tokenfab.server.protocol import ChatCompletionRequest
from tokenfab.server.state import ClientGone, ServerState, usage
from tokenfab.server.streaming import ChoiceDelta, framed, sse, sse_response
from tokenfab.server.tools import (InvalidToolCalls, ToolPlan, assistant_message, chat_constraints, stream_delta,
                                    template_input)
from tokenfab.structured_output import StructuredOutputParams

router = APIRouter()


def conversation_ids(st: ServerState, messages, add_generation_prompt: bool = True, tools=None) -> list[int]:
    """`tools`: the request's ToolPlan (server/tools.py), rendered into the prompt."""
    try:
        msgs, template_kw = template_input(st.tokenizer, [m.as_template_input() for m in messages], tools,
                                           st.config.tool_call_parser)
        ids = chat_token_ids(st.tokenizer, msgs, add_generation_prompt, **template_kw)
    except InvalidToolCalls as e:
        raise APIError(400, str(e), param=e.param, code="invalid_tool_calls") from None
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:                  # a template that fails on this input (jinja raise_exception)
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages",
                       code="chat_template_error") from None
    if not ids:
        raise APIError(400, "the chat template produced an empty prompt", param="messages",
                       code="chat_template_error")
    return ids


@dataclass(slots=True)
class PreparedChat:
    """A chat request checked and ready for the engine: what `prepare` gives the routes that run it."""
    ids: list[int]                  # the prompt, through the chat template
    params: SamplingParams
    tools: ToolPlan | None
    service_class: str
    top_n: int | None               # top_logprobs when logprobs were asked for, else None


async def chat_prompt(st: ServerState, req: ChatCompletionRequest) -> tuple[ToolPlan | None,
                                                                            StructuredOutputParams | None, list[int]]:
    """(the tool plan, the structured-output spec, the prompt's token ids) of a chat request; the
    prompt alone is what /v1/messages/count_tokens counts."""
    tools, structure = await chat_constraints(st, req)
    return tools, structure, conversation_ids(st, req.messages, req.add_generation_prompt, tools)


async def prepare(st: ServerState, req: ChatCompletionRequest) -> PreparedChat:
    """Every check of a chat request, then its prompt and SamplingParams; nothing is queued yet.
    /v1/chat/completions and /v1/messages (server/messages.py) both run requests prepared here."""
    st.check_model(req.model)
    st.check_supported(req)
    service_class = st.request_class(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    vocab = st.vocab_size
    check_request(req, st.config, 1, vocab)
    tools, structure, ids = await chat_prompt(st, req)
    max_tokens, max_param = req.requested_max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{max_param} must be at least 1, got {max_tokens}", param=max_param, code="invalid_value")
    st.check_length(len(ids), max_tokens, "messages", max_param)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = st.sampling_params({**req.sampling_kwargs(), "max_tokens": max_tokens, "logprobs": top_n,
                                 "logit_bias": logit_bias_ids(req.logit_bias, vocab),
                                 "structured_output": structure},
                                renames={"max_tokens": max_param, "logprobs": "top_logprobs"})
    return PreparedChat(ids, params, tools, service_class, top_n)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    st: ServerState = request.app.state.tokenfab
    req: ChatCompletionRequest = await st.parse(request, ChatCompletionRequest)
    p = await prepare(st, req)
    ids, params, tools, top_n = p.ids, p.params, p.tools, p.top_n

    rid = f"chatcmpl-{uuid.uuid4().hex}"
    access = request.state.access = {"id": rid, "prompt_tokens": len(ids), "output_tokens": 0}
    (stream,) = await st.start(rid, [ids], params, req.priority, arrival, p.service_class)
    if req.stream:
        return sse_response(framed(_stream(st, req, rid, stream, top_n, params.n, access, arrival, tools),
                                   [stream], access), rid)

    try:
        (final,) = await st.collect(request, [stream])
    except ClientGone:
        access["outcome"] = "client_disconnected"
        return Response(status_code=499)
    choices = []
    for o in final.outputs:
        lps = chat_logprobs(st.token_text, o.token_ids, o.logprobs or [], top_n) if top_n is not None else None
        message, finish_reason = assistant_message(tools, o.text, o.finish_reason)
        choices.append({"index": o.index, "message": message,
                        "logprobs": lps, "finish_reason": finish_reason, "stop_reason": o.stop_reason})
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    m = final.metrics
    access.update(output_tokens=completion_tokens,
                  ttft_s=m.first_token_time - arrival if m and m.first_token_time else None)
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": st.model_name,
            "choices": choices, "usage": usage(len(ids), completion_tokens)}
    return JSONResponse(body, headers={"X-Request-Id": rid})


async def _stream(st: ServerState, req: ChatCompletionRequest, rid: str, stream, top_n: int | None, n: int,
                  access: dict, arrival: float, tools=None):
    created = int(time.time())
    prompt_tokens = access["prompt_tokens"]
    deltas = [ChoiceDelta() for _ in range(n)]
    calls = [tools.parser.streamer() for _ in range(n)] if tools is not None and tools.parses else None

    def chunk(choices: list[dict], completion_tokens: int | None = None) -> dict:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "choices": choices}
        if completion_tokens is not None:
            body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    role_sent = False
    async for out in stream:
        if not role_sent:
            # The role first, as OpenAI does (the only chunk whose content is empty), but only once the
            # first token exists: as vLLM, so a client timing its first chunk measures the real TTFT.
            role_sent = True
            if access.get("ttft_s") is None:
                access["ttft_s"] = time.monotonic() - arrival
            yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(n)], 0 if req.continuous_usage else None))
        for o in out.outputs:
            delta = deltas[o.index].advance(o)
            if delta is None:
                continue
            body, finish_reason = ({"content": delta.text} if delta.text else {}), delta.finish_reason
            if calls is not None:     # tool calls: text inside <tool_call> tags leaves as tool_calls deltas
                body, finish_reason = stream_delta(calls[o.index], delta.text, delta.finish_reason)
                if not body and finish_reason is None:
                    continue
            lps = chat_logprobs(st.token_text, delta.token_ids, delta.logprobs, top_n) \
                if top_n is not None else None
            if access.get("ttft_s") is None and delta.text:
                access["ttft_s"] = time.monotonic() - arrival
            access["output_tokens"] = sum(d.token_count for d in deltas)
            yield sse(chunk([{"index": o.index, "delta": body,
                              "logprobs": lps, "finish_reason": finish_reason,
                              "stop_reason": delta.stop_reason}],
                            access["output_tokens"] if req.continuous_usage else None))
    if req.include_usage:
        yield sse(chunk([], access["output_tokens"]))
