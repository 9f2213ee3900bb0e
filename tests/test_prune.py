"""`tokenfab prune`: the layers and FFN channels it removes follow its criteria, and the pruned folder
loads in tokenfab and transformers alike (same greedy tokens), quantizes, and is measured by quant eval."""
import contextlib
import io
import json
import os

import pytest
import torch

from tests.oracle import FAMILY_PROMPTS, assert_greedy_matches_transformers, hf_greedy, make_tiny_model
from tokenfab.cli import main
from tokenfab.quant.prune import kept_channel_count, layer_count, layers_to_drop

pytestmark = pytest.mark.usefixtures("one_thread")

IDENTITY_LAYER = 2          # o_proj and down_proj zeroed: the layer's output equals its input
DEAD_CHANNELS = torch.arange(0, 128, 4)     # layer 0's up_proj rows zeroed: act(gate) * up is 0 there


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, bundled_tokenizer):
    from safetensors.torch import load_file, save_file
    d = str(tmp_path_factory.mktemp("tiny-prunable"))
    make_tiny_model("llama", d, bundled_tokenizer, num_hidden_layers=4)
    w = load_file(os.path.join(d, "model.safetensors"))
    w[f"model.layers.{IDENTITY_LAYER}.self_attn.o_proj.weight"].zero_()
    w[f"model.layers.{IDENTITY_LAYER}.mlp.down_proj.weight"].zero_()
    w["model.layers.0.mlp.up_proj.weight"][DEAD_CHANNELS] = 0
    save_file(w, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def pruned(tiny_dir, tmp_path_factory):
    """The tiny model with one layer and a quarter of its FFN channels removed, through the CLI."""
    out = str(tmp_path_factory.mktemp("pruned") / "out")
    rc, text = _run(["prune", tiny_dir, "--drop-layers", "1", "--ffn-fraction", "0.25", "--calib-tokens", "128",
                     "--out", out, "--json"])
    assert rc == 0
    return out, json.loads(text)


def _run(argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def test_the_identity_layer_is_the_one_removed(pruned):
    out, res = pruned
    assert res["dropped_layers"] == [IDENTITY_LAYER]
    dist = res["layer_distance"]
    assert dist[IDENTITY_LAYER] < 1e-6 and min(d for i, d in enumerate(dist) if i != IDENTITY_LAYER) > 0.01
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["num_hidden_layers"] == 3 and cfg["intermediate_size"] == 96


def test_ffn_channels_with_no_activation_are_the_ones_removed(tiny_dir, pruned):
    from safetensors.torch import load_file
    out, _ = pruned
    before, after = load_file(os.path.join(tiny_dir, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    kept = torch.tensor([c for c in range(128) if c not in set(DEAD_CHANNELS.tolist())])
    assert torch.equal(after["model.layers.0.mlp.gate_proj.weight"], before["model.layers.0.mlp.gate_proj.weight"][kept])
    assert torch.equal(after["model.layers.0.mlp.down_proj.weight"], before["model.layers.0.mlp.down_proj.weight"][:, kept])
    # layers after the removed one move down by one, whole
    assert torch.equal(after["model.layers.2.self_attn.q_proj.weight"], before["model.layers.3.self_attn.q_proj.weight"])


def test_ffn_channels_kept_are_the_strongest_by_mean_abs_activation_in_transformers(tiny_dir, pruned,
                                                                                     bundled_tokenizer):
    """Layer 1's kept channels are the 96 largest mean |act(gate) * up| over the calibration tokens, measured
    here on transformers' forward (the down projection's input), not on tokenfab's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tokenfab.quant.export import calibration_windows
    out, _ = pruned
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    seen = []
    hook = hf.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0]))
    with torch.no_grad():
        for w in calibration_windows(bundled_tokenizer, None, 128):
            hf(torch.tensor([w]))
    hook.remove()
    importance = torch.cat(seen).abs().mean(0)
    expected = torch.sort(torch.topk(importance, 96).indices).values
    before, after = load_file(os.path.join(tiny_dir, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(after["model.layers.1.mlp.up_proj.weight"], before["model.layers.1.mlp.up_proj.weight"][expected])


def test_pruned_model_gives_transformers_greedy_tokens_in_tokenfab(pruned):
    from transformers import AutoModelForCausalLM

    from tokenfab import LLM
    out, _ = pruned
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    llm = LLM(model=out, max_model_len=256, num_kv_blocks=64)
    assert_greedy_matches_transformers(llm, hf, new_tokens=12)


def test_pruned_then_quantized_folder_loads_and_quant_eval_reports_kl_and_speed(tiny_dir, pruned, tmp_path):
    from tokenfab import LLM, SamplingParams
    from tokenfab.quant.export import quantize_to_folder
    out, _ = pruned
    q = quantize_to_folder(out, "int8", str(tmp_path / "q"))
    assert q.quantized == 3 * 4
    llm = LLM(model=q.out, max_model_len=128, num_kv_blocks=32)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
               .outputs[0].token_ids) == 4
    rc, text = _run(["quant", "eval", "--base", tiny_dir, "--candidate", out, "--ctx", "48", "--max-windows", "1",
                     "--speed", "6", "--json"])
    res = json.loads(text)
    assert rc == 0 and res["tokens"] == 47 and res["kl_mean"] > 0
    speed = res["decode_speed"]
    assert speed["tokens"] == 6 and speed["base_tokens_per_s"] > 0 and speed["candidate_tokens_per_s"] > 0
    assert speed["speedup"] == pytest.approx(speed["candidate_tokens_per_s"] / speed["base_tokens_per_s"], rel=0.01)


def test_speed_decode_loop_gives_transformers_greedy_tokens(tiny_dir):
    from transformers import AutoModelForCausalLM

    from tokenfab.model.loader import load_model_files
    from tokenfab.quant.export import build_float_model
    from tokenfab.quant.speed import decode_speed
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    model = build_float_model(load_model_files(tiny_dir), 64)
    prompt = list(range(100, 120))
    tps, tokens = decode_speed(model, prompt, 10)
    assert tokens == hf_greedy(hf, prompt, 10) and tps > 0


def test_bundled_gguf_prunes_to_an_hf_folder_transformers_loads(bundled_files, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenfab import LLM
    from tokenfab.quant.prune import prune_to_folder
    res = prune_to_folder(None, str(tmp_path / "p"), drop_layers=2, calib_tokens=64, files=bundled_files)
    assert res.num_layers_after == 28 and len(res.dropped_layers) == 2 and 0 not in res.dropped_layers
    hf = AutoModelForCausalLM.from_pretrained(res.out, dtype=torch.float32).eval()
    llm = LLM(model=res.out, max_model_len=128, num_kv_blocks=32, kv_cache_dtype="float32")
    assert_greedy_matches_transformers(llm, hf, prompts=[[1, 504, 3458, 282, 4649, 314]], new_tokens=6)


def test_layer_and_channel_counts():
    assert layers_to_drop([0.3, 0.1, 0.2, 0.1], 2) == [1, 3]
    assert layers_to_drop([0.3, 0.1], 0) == []
    with pytest.raises(ValueError, match="can remove 0 to 1 of 2 layers"):
        layers_to_drop([0.3, 0.1], 2)
    assert kept_channel_count(1536, 0.1) == 1376 and kept_channel_count(1536, 0.0) == 1536
    assert kept_channel_count(128, 0.9) == 32
    assert layer_count(30, None, 0.2) == 6 and layer_count(30, None, 0.1) == 3 and layer_count(30, 4, None) == 4
    with pytest.raises(ValueError, match="not both"):
        layer_count(30, 4, 0.1)


@pytest.mark.parametrize("argv, says", [
    (["prune", "--out", "x"], "nothing to prune"),
    (["prune", "--drop-layers", "1"], "needs --out"),
    (["prune", "--drop-layers", "1", "--layers-fraction", "0.1", "--out", "x"], "not both"),
    (["prune", "--ffn-fraction", "1.5", "--out", "x"], "--ffn-fraction must be at least 0 and below 1"),
    (["prune", "--layers-fraction", "1", "--out", "x"], "--layers-fraction must be at least 0 and below 1"),
    (["prune", "--layers-fraction", "-0.1", "--out", "x"], "--layers-fraction must be at least 0 and below 1"),
    (["prune", "--drop-layers", "-2", "--out", "x"], "--drop-layers must be 0 or more"),
    (["prune", "--drop-layers", "1", "--calib-tokens", "1", "--out", "x"], "--calib-tokens must be at least 2"),
    (["prune", "--drop-layers", "1", "--calib", "/no/such.txt", "--out", "x"], "--calib /no/such.txt: no such file"),
    (["prune", "/no/such/model", "--drop-layers", "1", "--out", "x"], "no such file or folder"),
])
def test_prune_mistakes_exit_2_with_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_prune_prints_the_sizes_and_an_eval_command_against_its_own_source(tiny_dir, tmp_path):
    out = str(tmp_path / "o")
    rc, text = _run(["prune", tiny_dir, "--drop-layers", "1", "--calib-tokens", "32", "--out", out])
    text = " ".join(text.split())       # rich wraps lines at the terminal width
    assert rc == 0 and "layers 4 → 3 (removed [2])" in text and "FFN 128 → 128 channels" in text
    assert f"tokenfab quant eval --base {tiny_dir} --candidate {out} --speed" in text


def test_removing_every_layer_is_refused_by_name(tiny_dir, tmp_path, capsys):
    assert main(["prune", tiny_dir, "--drop-layers", "4", "--out", str(tmp_path / "o")]) == 2
    assert "at most 3 can be removed" in capsys.readouterr().err


def test_removing_an_identity_layer_keeps_greedy_tokens_and_cuts_per_layer_config(tmp_path, bundled_tokenizer):
    """SmolLM3 (RoPE left out on its last layer, a per-layer list in config.json): with layer 1 an identity,
    pruning removes it, the list loses entry 1, and greedy tokens equal the unpruned model's in both
    tokenfab and transformers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tokenfab import LLM
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    make_tiny_model("smollm3", src, bundled_tokenizer)
    w = load_file(os.path.join(src, "model.safetensors"))
    w["model.layers.1.self_attn.o_proj.weight"].zero_()
    w["model.layers.1.mlp.down_proj.weight"].zero_()
    save_file(w, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    rc, text = _run(["prune", src, "--drop-layers", "1", "--calib-tokens", "64", "--out", out, "--json"])
    assert rc == 0 and json.loads(text)["dropped_layers"] == [1]
    before, after = (json.loads(open(os.path.join(d, "config.json")).read()) for d in (src, out))
    assert before["no_rope_layers"] == [1, 1, 1, 0] and after["no_rope_layers"] == [1, 1, 0]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    unpruned = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    llm = LLM(model=out, max_model_len=256, num_kv_blocks=64)
    tokens = assert_greedy_matches_transformers(llm, hf, new_tokens=12)
    assert tokens == [hf_greedy(unpruned, p, 12) for p in FAMILY_PROMPTS]
