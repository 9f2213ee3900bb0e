"""SpeculativeConfig: `EngineConfig.speculative_config` (a dict, as vLLM takes it), validated.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM(speculative_config={"method": "layerskip", "num_speculative_tokens": 3, "num_layers": 20})
    LLM(speculative_config={"method": "draft", "model": "path/to/small.gguf", "num_speculative_tokens": 4})
    tokenfab serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("ngram", "draft", "layerskip")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4       # k: the most draft tokens per sequence and step
    prompt_lookup_max: int = 4            # ngram: the longest suffix matched against the context
    prompt_lookup_min: int = 2            # ngram: the shortest
    num_layers: int | None = None         # layerskip: the target's first L layers draft; None: 0.8 of them (24 of 30; docs/speculative.md)
    model: str | None = None              # draft: the draft model (GGUF file or HF folder), same vocabulary
    # Adaptive policy (docs/speculative.md). The batch switch: no speculation in a step whose
    # running decodes exceed this. Measured (benchmarks/speculative.py, 1 thread): at 8 streams a
    # 16-row verification step cost 2.0x a decode step for 1.9x the tokens; at 4 streams, 2.5x for
    # up to 3.9x.
    max_batch_size: int = 4
    # Rows (decodes + drafts) a step with drafts may have: 16 keeps it on the one-call C decode stack
    # (kernels.QGEMM_MAX_ROWS); drafts beyond it are not proposed.
    max_step_rows: int = 16
    adaptive: bool = True                 # k per sequence from its recent acceptance; back-off when it keeps rejecting

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict like {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if "method" not in d:
            raise ValueError(f"speculative_config needs a method, one of {', '.join(METHODS)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_batch_size",
                     "max_step_rows", "num_layers"):
            v = getattr(self, name)
            if v is None and name == "num_layers":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method 'draft' needs \"model\": the path of a smaller model "
                             "(GGUF file or HF folder) with the target's tokenizer")
        if self.model is not None and self.method != "draft":
            raise ValueError(f"speculative_config model is for method 'draft', not {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config num_speculative_tokens must be at most 32, got {self.num_speculative_tokens}")
