"""Weight quantization and its quality report.

    schemes.py       quantize / dequantize functions and error bounds (int8 per channel, int4 groups)
    gguf_blocks.py   GGUF Q8_0 / Q4_0 / Q4_1 blocks decoded to tensors, no requantization
    kernels.py       packed torch CPU kernels vs dequantize-then-GEMM, picked per call
    linear.py        nn.Linear replacements: Int8Linear, Int4Linear, Q4_0Linear, Q4_1Linear, Q8_0Linear
    awq.py           calibration hooks and the AWQ scale search
    apply.py         quantize_model(model, scheme, keep_float, calib)
    checkpoint.py    save_quantized / load_quantized / apply_checkpoint
    eval.py          KL, same top-1, Δp and perplexity from two logits tensors
    sensitivity.py   per-layer KL when only that layer is quantized
    text.py          the bundled human-written evaluation text, its eval/calibration split, windows
    export.py        quantize a model file into a checkpoint folder (`tokenfab quant`)
    compare.py       a candidate against the float base over text windows (`tokenfab quant eval`)
    cli.py           the `tokenfab quant` command

This package file imports nothing, so the CLI can register `tokenfab quant` without importing torch.
"""
