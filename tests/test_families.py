"""The family registry (model/families/): every family it runs is checked against transformers somewhere, and
config.json / GGUF architectures resolve to the family that reads them."""
import pytest

from tests.oracle import TINY_CONFIGS
from tokenfab.model import families
from tokenfab.model.config import ModelConfig


def test_every_registered_family_has_a_tiny_transformers_oracle():
    covered = {c["model_type"] for c in TINY_CONFIGS.values()} | {"gemma3_text"}    # gemma3: tests/test_gemma3.py
    for arch in families.supported():
        assert covered & set(families.for_gguf(arch).hf_model_types), f"{arch} has no tiny model in tests/oracle.py"


@pytest.mark.parametrize("model_type,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("gemma3_text", "gemma3"),
                                             ("gemma3", "gemma3"), ("smollm3", "smollm3"), ("granite", "granite"),
                                             ("phi3", "phi3"), ("qwen3_moe", "qwen3moe"), ("mixtral", "mixtral"),
                                             ("olmoe", "olmoe"), ("gpt_oss", "gpt-oss")])
def test_config_json_model_types_resolve_to_their_family(model_type, arch):
    assert families.for_hf(model_type).arch == arch
    assert families.for_gguf(arch).arch == arch


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'; supported: .*granite, llama, .*smollm3"):
        ModelConfig.from_hf(dict(model_type="gpt2", vocab_size=10, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=4))
    assert families.for_gguf("gpt2") is None
