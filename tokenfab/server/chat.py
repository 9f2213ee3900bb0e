"""POST /v1/chat/completions: messages through the model's chat template, streamed or not.

`max_completion_tokens` (or the older `max_tokens`) bounds the reply; unset, it may run to
max_model_len. `logprobs: true` with `top_logprobs: k` gives OpenAI's chat logprobs format.
`prepare` is the one place a chat request is checked and turned into a prompt and SamplingParams;
/v1/messages (server/messages.py) maps its body onto a chat request and runs it through `prepare` too.
`chat_template_kwargs` (vLLM's field) reach the template as variables, e.g. Qwen3's `enable_thinking`.
With `--reasoning-parser`, the reply's reasoning goes to `reasoning_content` (server/reply.py).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.llm import chat_token_ids
from tokenfab.sampling import SamplingParams
from tokenfab.server.errors import APIError
from tokenfab.server.limits import check_request, logit_bias_ids
from tokenfab.server.logprobs import chat_logprobs
from tokenfab.server.protocol import ChatCompletionRequest
from tokenfab.server.reasoning import parser_for as reasoning_parser_for
from tokenfab.server.reply import Reply
from tokenfab.server.state import ServerState, usage
from tokenfab.server.streaming import ChoiceDelta, framed, sse, sse_response
from tokenfab.server.tools import InvalidToolCalls, ToolPlan, chat_constraints, template_input
from tokenfab.structured_output import StructuredOutputParams

router = APIRouter()


# apply_chat_template's own parameters: as chat_template_kwargs they would change how it runs, not what
# the template sees.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: dict | None) -> dict:
    """`chat_template_kwargs`: extra variables for the chat template. A variable the template does not
    use is ignored by Jinja; a name of apply_chat_template's own parameters is a 400."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"chat_template_kwargs.{key} is a parameter of the template rendering, not a "
                                "template variable; give variables such as enable_thinking",
                           param=f"chat_template_kwargs.{key}", code="invalid_value")
    return dict(kwargs or {})


def conversation_ids(st: ServerState, messages, add_generation_prompt: bool = True, tools=None,
                     template_kwargs: dict | None = None) -> list[int]:
    """`tools`: the request's ToolPlan (server/tools.py), rendered into the prompt; `template_kwargs`:
    the request's chat_template_kwargs."""
    extra = check_template_kwargs(template_kwargs)
    try:
        msgs, template_kw = template_input(st.tokenizer, [m.as_template_input() for m in messages], tools,
                                           st.config.tool_call_parser)
        ids = chat_token_ids(st.tokenizer, msgs, add_generation_prompt, **extra, **template_kw)
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
    reply: Reply                    # how the output is read: tool calls, reasoning
    service_class: str
    top_n: int | None               # top_logprobs when logprobs were asked for, else None


async def chat_prompt(st: ServerState, req: ChatCompletionRequest) -> tuple[ToolPlan | None,
                                                                            StructuredOutputParams | None, list[int]]:
    """(the tool plan, the structured-output spec, the prompt's token ids) of a chat request; the
    prompt alone is what /v1/messages/count_tokens counts."""
    tools, structure = await chat_constraints(st, req)
    return tools, structure, conversation_ids(st, req.messages, req.add_generation_prompt, tools,
                                              req.chat_template_kwargs)


def reply_plan(st: ServerState, tools: ToolPlan | None, structure: StructuredOutputParams | None,
               ids: list[int]) -> Reply:
    """How the output is read. A grammar (structured output, a forced tool call) constrains the output
    from its first token, so a constrained reply has no reasoning part: the parser is off for it."""
    reasoning = reasoning_parser_for(st.config.reasoning_parser) if structure is None else None
    inside = reasoning.starts_inside(st.tokenizer.decode(ids[-8:])) if reasoning is not None else None
    return Reply(tools, reasoning, inside)


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
    return PreparedChat(ids, params, reply_plan(st, tools, structure, ids), service_class, top_n)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    st: ServerState = request.app.state.tokenfab
    req: ChatCompletionRequest = await st.parse(request, ChatCompletionRequest)
    p = await prepare(st, req)
    ids, params, reply, top_n = p.ids, p.params, p.reply, p.top_n

    rid = f"chatcmpl-{uuid.uuid4().hex}"
    access = request.state.access = {"id": rid, "prompt_tokens": len(ids), "output_tokens": 0}
    (stream,) = await st.start(rid, [ids], params, req.priority, arrival, p.service_class)
    if req.stream:
        return sse_response(framed(chunks(st, req, rid, stream, top_n, params.n, access, arrival, reply),
                                   [stream], access), rid)

    (final,) = await st.collect(request, [stream])
    choices = []
    for o in final.outputs:
        lps = chat_logprobs(st.token_text, o.token_ids, o.logprobs or [], top_n) if top_n is not None else None
        message, finish_reason = reply.message(o.text, o.finish_reason)
        choices.append({"index": o.index, "message": message,
                        "logprobs": lps, "finish_reason": finish_reason, "stop_reason": o.stop_reason})
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    m = final.metrics
    access.update(output_tokens=completion_tokens,
                  ttft_s=m.first_token_time - arrival if m and m.first_token_time else None)
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": st.model_name,
            "choices": choices, "usage": usage(len(ids), completion_tokens)}
    return JSONResponse(body, headers={"X-Request-Id": rid})


async def chunks(st: ServerState, req: ChatCompletionRequest, rid: str, stream, top_n: int | None, n: int,
                 access: dict, arrival: float, reply: Reply) -> AsyncIterator[str]:
    """The SSE chunks of a streamed reply from its engine stream (RequestOutputs, cumulative per choice).
    A chunk goes out when a choice has reasoning, content, tool calls or a finish reason to send; the
    tokens of text a parser still holds back (a possible tag) wait, with their logprobs, for the next."""
    created = int(time.time())
    prompt_tokens = access["prompt_tokens"]
    deltas = [ChoiceDelta() for _ in range(n)]
    replies = [reply.stream() for _ in range(n)]
    held: list[tuple[list[int], list]] = [([], []) for _ in range(n)]     # (token ids, logprobs) not yet sent

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
            ids, lps = held[o.index]
            ids += delta.token_ids
            lps += delta.logprobs
            body, finish_reason = replies[o.index].feed(delta.text, delta.finish_reason)
            if not body and finish_reason is None:
                continue
            held[o.index] = ([], [])
            logprobs = chat_logprobs(st.token_text, ids, lps, top_n) if top_n is not None else None
            if access.get("ttft_s") is None and delta.text:
                access["ttft_s"] = time.monotonic() - arrival
            access["output_tokens"] = sum(d.token_count for d in deltas)
            yield sse(chunk([{"index": o.index, "delta": body,
                              "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": delta.stop_reason}],
                            access["output_tokens"] if req.continuous_usage else None))
    if req.include_usage:
        yield sse(chunk([], access["output_tokens"]))
