"""tokenfab bench: load generation and measurement for OpenAI-compatible servers, and the offline engine.

`tokenfab bench serve` talks HTTP to any OpenAI-compatible endpoint (ours, vLLM, SGLang,
llama.cpp's server) and reports the metrics exactly as vLLM's `bench serve` defines them
(DESIGN.md §6). Modules, in the order a run flows through them:

  lengths.py    length distributions for prompts and outputs
  tokens.py     exact token counts (the target's tokenizer) or approximate ones, and text of an exact length
  datasets.py   random, shared-prefix, mixed and jsonl request sets
  arrivals.py   when each request is due: Poisson / gamma arrivals
  client.py     one streaming request, timed per SSE chunk
  timing.py     one request's TTFT, ITL, TPOT, E2E from its timed chunks and token counts
  aggregate.py  throughput, goodput and percentiles, overall and per prompt-length bucket
  serving.py    runs: warm-up, dispatch on schedule under a concurrency cap, sweeps
  schema.py     the JSON result: its stable layout, writing and loading
  report.py     rich tables;  plots.py  PNG plots;  compare.py  runs side by side
  offline.py    `bench offline`: prefill and decode tok/s of the in-process engine

`bench serve --dataset agent` runs sessions instead of independent requests:
  agent.py          the workload: shared system prompt and tools, turns, think times, the next turn's messages
  chat_tools.py     how tools, tool calls and tool results are rendered for counting a prompt's tokens
  agent_run.py      sessions on the arrival schedule under a session cap, turns in order; their records
  session_stats.py  TTFT by turn, session times, tokens re-sent against new
  prefix_cache.py   the server's prefix-cache hit rate from /metrics, before and after a run

`tokenfab bench soak` runs a mixed load for hours, in windows, and judges the drift:
  soak_mix.py   the request mix: chat/completions, streamed or not, short/long, hang-ups, structured output
  soak.py       the windows: dispatch, drain, an idle sample of the server, a summary per window
  probe.py      the server's RSS, threads, descriptors and KV blocks in use, from /metrics or /proc
  drift.py      windows in, verdict out: RSS slope, P99 against the baseline, leaked blocks, errors
  soak_cli.py   the handler: flags to config, live lines, tables, JSON, plot, exit code
  fake_server.py  a scripted OpenAI-compatible server with known timing, for tests and self-checks
"""
