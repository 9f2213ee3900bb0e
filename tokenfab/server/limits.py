"""Per-request caps, so that one request cannot monopolise the server, and `logit_bias` parsing.

Every check raises a 400 that names the field and carries a machine-readable code. The caps that a
deployment may want to move are `ServerConfig` fields (`--max-n`, `--max-request-sequences`); the
others are fixed here, each with the reason for its value.
"""
from __future__ import annotations

from tokenfab.server.config import ServerConfig
from tokenfab.server.errors import APIError

MAX_STOP_STRINGS = 64            # every stop string is searched for after each token
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024    # OpenAI's own bound is a few hundred; vocabularies hold ~50-150k ids
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)   # what torch.Generator.manual_seed takes
MAX_METADATA_KEYS = 16           # OpenAI's bounds on `metadata` (batches, responses): 16 keys of 64
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512    # characters, each to 512 characters


def check_request(req, config: ServerConfig, num_prompts: int, vocab_size: int) -> None:
    """The caps on a completions or chat request (fields shared by both: protocol.SamplingFields)."""
    n = req.n if req.n is not None else 1
    if n > config.max_n:
        raise APIError(400, f"n is {n} but this server allows at most {config.max_n} choices per request "
                            "(--max-n)", param="n", code="invalid_value")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of > config.max_n:
        raise APIError(400, f"best_of is {best_of} but this server allows at most {config.max_n} (--max-n)",
                       param="best_of", code="invalid_value")
    if n * num_prompts > config.max_request_sequences:
        raise APIError(400, f"{num_prompts} prompt(s) x n={n} would start {n * num_prompts} sequences, more than "
                            f"the {config.max_request_sequences} one request may (--max-request-sequences); "
                            "split the batch", param="prompt" if num_prompts > 1 else "n", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                       param="stop", code="invalid_value")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise APIError(400, f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters", param="stop",
                       code="invalid_value")
    if len(req.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids",
                       code="invalid_value")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise APIError(400, f"seed must be a 64-bit integer, got {req.seed}", param="seed", code="invalid_value")
    logit_bias_ids(req.logit_bias, vocab_size)


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token id as a string -> bias in [-100, 100]) with int keys."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise APIError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                       param="logit_bias", code="invalid_value")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            tid = None
        if tid is None or not 0 <= tid < vocab_size:
            raise APIError(400, f"logit_bias key {key[:40]!r} is not a token id in [0, {vocab_size})",
                           param="logit_bias", code="invalid_value")
        if not -100 <= value <= 100:      # also false for NaN
            raise APIError(400, f"logit_bias[{key!r}] is {value}; a bias must be in [-100, 100]",
                           param="logit_bias", code="invalid_value")
        out[tid] = float(value)
    return out


def check_metadata(metadata) -> None:
    """OpenAI's `metadata`: at most 16 string keys (64 characters) mapped to strings (512 characters)."""
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_KEYS and all(
            isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS and isinstance(v, str)
            and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items())):
        raise APIError(400, f"metadata must map at most {MAX_METADATA_KEYS} keys ({MAX_METADATA_KEY_CHARS} "
                            f"characters) to strings ({MAX_METADATA_VALUE_CHARS} characters)", param="metadata",
                       code="invalid_value")
