"""Shared fixtures: the bundled model's path and tokenizer, loaded once per session."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bundled_path() -> str:
    from tokenfab.model.bundled import bundled_model_path
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_path):
    from tokenfab.model.tokenizer import load_tokenizer
    return load_tokenizer(bundled_path)
