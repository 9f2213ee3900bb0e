"""LLM: the offline API, shaped like vLLM's so users and tools can switch.

    from tokenfab import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq

from tokenfab.config import EngineConfig
from tokenfab.engine.engine import LLMEngine
from tokenfab.outputs import RequestOutput
from tokenfab.sampling import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, *, loaded=None, kv_connector=None, **engine_kwargs):
        """`engine_kwargs` are EngineConfig fields (vLLM's names). `loaded`: reuse files already read.
        `kv_connector`: a KV connector (engine/kv_connector.py); none by default."""
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.engine = LLMEngine(self.config, loaded=loaded, kv_connector=kv_connector)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what runs beside this process (tensor-parallel worker ranks). Also done at exit."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, priority: Seq[int] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in input order.

        Bad input raises ValueError before anything is queued, so the engine stays usable.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        # Validate everything first: a bad prompt in the middle must not leave half a batch queued.
        for p in prompts:
            self.engine.check_prompt_length(len(self.engine.tokenize(p)))
        for sp in {id(sp): sp for sp in params}.values():   # structured output: compiles (cached for add_request)
            if isinstance(sp, SamplingParams) and sp.structured_output is not None:
                self.engine.structured.compile(sp.structured_output)
        rids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, p, sp, pr in zip(rids, prompts, params, prios):
            self.engine.add_request(rid, p, sp, priority=pr)
        return self._run(rids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             *, add_generation_prompt: bool = True, use_tqdm: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True, **kw) -> list[int]:
        return chat_token_ids(self.engine.tokenizer, conversation, add_generation_prompt, **kw)

    def _run(self, rids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        show = use_tqdm and sys.stderr.isatty()
        progress = None
        if show:
            from rich.progress import Progress
            progress = Progress(transient=True)
            task = progress.add_task("generating", total=len(rids))
            progress.start()
        try:
            while len(final) < len(rids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if progress:
                            progress.advance(task)
        except BaseException:
            for rid in rids:            # leave nothing queued or holding blocks
                self.engine.abort_request(rid)
            raise
        finally:
            if progress:
                progress.stop()
        return [final[r] for r in rids]


def chat_token_ids(tokenizer, conversation: list[Message], add_generation_prompt: bool = True, **kw) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, with clear errors."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a role and content")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise ValueError(f"messages[{i}].role {m['role']!r} is not one of system, user, assistant, tool")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; use a plain completion prompt")
    out = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)
