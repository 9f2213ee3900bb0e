"""ServerConfig: the HTTP side's knobs (the engine's are in tokenfab.config.EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 16 << 20      # a 128k-token prompt as JSON token ids is about 1 MB


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"                  # loopback by default: exposing a server is a decision
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)          # empty (and no key_policies): no auth
    key_policies: list = field(default_factory=list)           # server/keys.py KeyPolicy: keys with limits
    auth_all_routes: bool = False            # the key on /metrics, /version and the web page too (not /health)
    served_model_names: list[str] = field(default_factory=list)  # empty: the model file's name
    max_waiting_requests: int | None = 1024  # queued beyond the running batch; more get 429. None: no cap
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: list[str] = field(default_factory=list)   # CORS; empty: no CORS headers at all
    shutdown_timeout: float = 30.0           # seconds to drain in-flight requests after SIGTERM
    access_log: bool = True
    ui: bool = True                          # the web page at / (chat, dashboard, bench viewer, doctor)
    max_n: int = 128                         # choices per request (OpenAI's limit); more get 400
    max_request_sequences: int = 1024        # prompts x n one request may start; more get 400
    data_dir: str | None = None              # Batch API files and jobs (SQLite); None: a temporary dir, not durable
    batch_max_file_bytes: int = 200 << 20    # per uploaded file (OpenAI's limit)
    batch_max_total_bytes: int = 10 << 30    # all stored files together
    batch_concurrency: int | None = None     # batch lines in the engine at once; None: the engine's max_num_seqs
    slo_ttft_ms: float | None = None         # interactive TTFT target: shed (429) what cannot meet it (server/slo.py)
    slo_tpot_ms: float | None = None         # interactive TPOT target
    batch_priority: int | None = 1           # priority at or above this (service_tier auto/none): batch class; None: never
    tool_call_parser: str | None = None      # server/tool_parsers.py PARSERS name; None: chosen by the chat template
    reasoning_parser: str | None = None      # server/reasoning.py PARSERS name; None: no reasoning split (all content)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.max_n < 1 or self.max_request_sequences < 1:
            raise ValueError(f"max_n and max_request_sequences must be >= 1, got {self.max_n}, "
                             f"{self.max_request_sequences}")
        if self.batch_max_file_bytes < 1 or self.batch_max_total_bytes < self.batch_max_file_bytes:
            raise ValueError("batch_max_file_bytes must be >= 1 and batch_max_total_bytes at least as large")
        if self.batch_concurrency is not None and self.batch_concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be a positive number of milliseconds, got {v}")
        from tokenfab.server.tool_parsers import check_parser_name
        check_parser_name(self.tool_call_parser)
        from tokenfab.server.reasoning import check_parser_name as check_reasoning_parser
        check_reasoning_parser(self.reasoning_parser)
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
