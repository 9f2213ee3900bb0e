"""POST /v1/completions: prompts (text, token ids, or lists of either) in, text out, streamed or not.

Several prompts become one engine request each; choice `index` is prompt_index * n + sample_index,
as OpenAI numbers them. `echo` puts the prompt in front of each choice's text; with `logprobs` it
puts the prompt tokens' logprobs (computed in the prefill: SamplingParams.prompt_logprobs) in front
of the completion's, the first one null, as OpenAI's legacy format has it. `max_tokens: 0` generates
nothing (finish_reason "length"): with `echo` and `logprobs`, it scores the prompt alone (lm-eval's
loglikelihood requests).
"""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.server.errors import APIError
from tokenfab.server.limits import check_request, logit_bias_ids
from tokenfab.server.logprobs import completion_logprobs, echo_logprobs
from tokenfab.server.protocol import CompletionRequest
from tokenfab.server.state import ServerState, usage
from tokenfab.server.streaming import ChoiceDelta, framed, merged, sse, sse_response
from tokenfab.server.structured import check_compiles, requested_structure

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    st: ServerState = request.app.state.tokenfab
    req: CompletionRequest = await st.parse(request, CompletionRequest)
    st.check_model(req.model)
    st.check_supported(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
    service_class = st.request_class(req)
    prompts = req.prompts()
    vocab = st.vocab_size
    check_request(req, st.config, len(prompts), vocab)
    prompt_ids = [st.prompt_ids(p, "prompt") for p in prompts]
    for ids in prompt_ids:
        st.check_length(len(ids), req.max_tokens, "prompt", "max_tokens")
    structure, structure_param = requested_structure(req)      # vLLM's guided_* extras
    if structure is not None:
        await check_compiles(st.client, structure, structure_param)
    prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
    params = st.sampling_params({**req.sampling_kwargs(), "max_tokens": req.max_tokens, "logprobs": req.logprobs,
                                 "prompt_logprobs": prompt_lps, "logit_bias": logit_bias_ids(req.logit_bias, vocab),
                                 "structured_output": structure})

    rid = f"cmpl-{uuid.uuid4().hex}"
    access = request.state.access = {"id": rid, "prompt_tokens": sum(map(len, prompt_ids)), "output_tokens": 0}
    streams = await st.start(rid, prompt_ids, params, req.priority, arrival, service_class)
    echoes = [p if isinstance(p, str) else st.tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids)] \
        if req.echo else None
    if req.stream:
        return sse_response(framed(_stream(st, req, rid, streams, prompt_ids, echoes, params.n, access, arrival),
                                   streams, access), rid)

    finals = await st.collect(request, streams)
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            lps = None
            if req.logprobs is not None:
                start = len(echoes[i]) if echoes else 0
                lps, _ = completion_logprobs(st.token_text, o.token_ids, o.logprobs or [], req.logprobs, start)
                if echoes:
                    lps = echo_logprobs(st.token_text, prompt_ids[i], out.prompt_logprobs, req.logprobs, lps, start)
            choices.append({"index": i * params.n + o.index, "text": (echoes[i] if echoes else "") + o.text,
                            "logprobs": lps, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    first_tokens = [o.metrics.first_token_time for o in finals if o.metrics and o.metrics.first_token_time]
    access.update(output_tokens=completion_tokens, ttft_s=min(first_tokens) - arrival if first_tokens else None)
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": st.model_name,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": usage(access["prompt_tokens"], completion_tokens)}
    return JSONResponse(body, headers={"X-Request-Id": rid})


async def _stream(st: ServerState, req: CompletionRequest, rid: str, streams, prompt_ids, echoes, n: int,
                  access: dict, arrival: float):
    created = int(time.time())
    deltas: dict[int, ChoiceDelta] = {}
    offsets: dict[int, int] = {}
    prompt_tokens = access["prompt_tokens"]

    def chunk(choices: list[dict], completion_tokens: int | None = None) -> dict:
        body = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": choices}
        if completion_tokens is not None:
            body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    async for i, out in merged(streams):
        for o in out.outputs:
            k = i * n + o.index
            d = deltas.setdefault(k, ChoiceDelta())
            delta = d.advance(o)
            if delta is None:
                continue
            text, first = delta.text, d.first
            if first and echoes:
                text = echoes[i] + text
            d.first = False
            lps = None
            if req.logprobs is not None:
                start = offsets.get(k, len(echoes[i]) if echoes else 0)
                lps, offsets[k] = completion_logprobs(st.token_text, delta.token_ids, delta.logprobs,
                                                      req.logprobs, start)
                if first and echoes:     # the prompt's logprobs go out with the echoed prompt
                    lps = echo_logprobs(st.token_text, prompt_ids[i], out.prompt_logprobs, req.logprobs, lps, start)
            if access.get("ttft_s") is None and text:
                access["ttft_s"] = time.monotonic() - arrival
            access["output_tokens"] = sum(c.token_count for c in deltas.values())
            yield sse(chunk([{"index": k, "text": text, "logprobs": lps, "finish_reason": delta.finish_reason,
                              "stop_reason": delta.stop_reason}],
                            access["output_tokens"] if req.continuous_usage else None))
    if req.include_usage:
        yield sse(chunk([], access["output_tokens"]))
