"""The OpenAI Batch API's core, shared by the server (`/v1/files`, `/v1/batches`) and the offline
runner (`tokenfab batch run`): input lines (lines.py), the durable store (store.py), the bounded-concurrency
runner (runner.py), the server's batch jobs (service.py) and the resumable offline run (offline.py).
A line goes through the server's own route code, which the server hands in (server/batch_dispatch.py),
so this part imports no other part of tokenfab."""
