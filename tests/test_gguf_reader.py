"""The GGUF reader (model/loader.py open_gguf): gguf's own reader with arrays read in one pass, which must give
every field's contents as gguf.GGUFReader does; and a model built from a file never imports torch._dynamo
(torch's meta-device kernels pull it in: two seconds of every start)."""
import subprocess
import sys

import gguf


def test_open_gguf_reads_every_field_as_ggufs_reader_does(bundled_path):
    from tokenfab.model.loader import open_gguf
    ours, ref = open_gguf(bundled_path), gguf.GGUFReader(bundled_path)
    assert list(ours.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    tokens = "tokenizer.ggml.tokens"
    assert len(ours.fields[tokens].data) == len(ref.fields[tokens].data) > 40000
    assert ours.fields[tokens].contents(7) == ref.fields[tokens].contents(7)
    assert [(t.name, t.tensor_type, int(t.n_elements)) for t in ours.tensors] == \
           [(t.name, t.tensor_type, int(t.n_elements)) for t in ref.tensors]


def test_loading_a_model_does_not_import_torch_dynamo():
    code = ("import sys\nfrom tokenfab import LLM\nLLM(max_model_len=256, num_kv_blocks=32)\n"
            "assert 'torch._dynamo' not in sys.modules, 'the load imported torch._dynamo'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
