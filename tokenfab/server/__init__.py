"""The OpenAI-compatible HTTP server (`tokenfab serve`): FastAPI routes over an EngineClient.

app.py builds the app; completions.py and chat.py are the generation routes, messages.py (with
messages_protocol.py and messages_reply.py) Anthropic's Messages API over chat's; protocol.py the request
schemas; errors.py the OpenAI and Anthropic error shapes; middleware.py auth, body limit and access log; metrics.py
/metrics; launch.py runs it under uvicorn; cli.py is the command. See docs/serving.md.
"""
