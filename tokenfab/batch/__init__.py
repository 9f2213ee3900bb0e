"""The OpenAI Batch API's core, shared by the server (`/v1/files`, `/v1/batches`) and the offline
runner (`tokenfab batch run`): input lines (lines.py), the durable store (store.py), one line through
the server's own route code (dispatch.py), and the bounded-concurrency runner (runner.py)."""
