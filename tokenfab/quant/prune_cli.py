"""`tokenfab prune`: remove decoder layers and FFN channels chosen on calibration text (quant/prune.py).

    tokenfab prune [MODEL] --out DIR [--drop-layers N | --layers-fraction F] [--ffn-fraction F]
                   [--calib FILE] [--calib-tokens N] [--json]

Registering the parser imports neither torch nor the pruning code.
"""
from __future__ import annotations

import json


def add_parser(subs) -> None:
    p = subs.add_parser(
        "prune", help="remove whole decoder layers and FFN channels, chosen on calibration text",
        description="Score MODEL (default: the bundled model) on calibration text and write a smaller HF folder "
                    "that tokenfab and transformers load. Layers: the ones whose output is closest to their input "
                    "(mean angular distance) go. FFN channels: the ones with the smallest mean |act(gate) * up| go. "
                    "Measure the result with `tokenfab quant eval --candidate DIR --speed`; quantize it with "
                    "`tokenfab quant DIR --scheme ...`.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or HF folder (default: the bundled model)")
    p.add_argument("--out", metavar="DIR", required=False, help="folder to write (new or empty)")
    p.add_argument("--drop-layers", type=int, metavar="N", default=None, help="decoder layers to remove")
    p.add_argument("--layers-fraction", type=float, metavar="F", default=None,
                   help="fraction of the decoder layers to remove, e.g. 0.2 (rounded to whole layers)")
    p.add_argument("--ffn-fraction", type=float, metavar="F", default=0.0,
                   help="fraction of each layer's FFN channels to remove (kept count rounded to a multiple of 32)")
    p.add_argument("--calib", metavar="FILE", help="calibration text (default: the bundled text's calibration "
                   "slice, disjoint from what `quant eval` scores)")
    p.add_argument("--calib-tokens", type=int, metavar="N", default=None, help="calibration tokens (default: 1024)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--num-threads", type=int, metavar="N", default=None,
                   help="torch intra-op threads (default: as `tokenfab quant`)")
    p.set_defaults(func=cmd_prune)


def cmd_prune(args) -> int:
    import os

    from tokenfab.cli_errors import CLIError
    if not args.out:
        raise CLIError("prune needs --out DIR, the folder to write the pruned model into")
    if args.drop_layers is None and args.layers_fraction is None and not args.ffn_fraction:
        raise CLIError("nothing to prune: give --drop-layers N or --layers-fraction F, and/or --ffn-fraction F")
    if args.drop_layers is not None and args.layers_fraction is not None:
        raise CLIError("give --drop-layers or --layers-fraction, not both")
    if args.drop_layers is not None and args.drop_layers < 0:
        raise CLIError(f"--drop-layers must be 0 or more, got {args.drop_layers}")
    for flag, v in (("--layers-fraction", args.layers_fraction), ("--ffn-fraction", args.ffn_fraction)):
        if v is not None and not 0 <= v < 1:
            raise CLIError(f"{flag} must be at least 0 and below 1, got {v}")
    if args.calib_tokens is not None and args.calib_tokens < 2:
        raise CLIError(f"--calib-tokens must be at least 2, got {args.calib_tokens}")
    if args.calib and not os.path.isfile(args.calib):
        raise CLIError(f"--calib {args.calib}: no such file")
    from tokenfab.quant.cli import _status, _threads
    _threads(args)
    from tokenfab.quant.prune import DEFAULT_PRUNE_CALIB_TOKENS, prune_to_folder
    with _status() as status:
        res = prune_to_folder(args.model, args.out, drop_layers=args.drop_layers, layers_fraction=args.layers_fraction,
                              ffn_fraction=args.ffn_fraction or 0.0, calib_path=args.calib,
                              calib_tokens=args.calib_tokens or DEFAULT_PRUNE_CALIB_TOKENS, progress=status.update)
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
        return 0
    from rich.console import Console
    base = f" --base {args.model}" if args.model else ""     # eval's base defaults to the bundled model
    Console().print(
        f"layers {res.num_layers_before} → {res.num_layers_after} (removed {res.dropped_layers or 'none'}), "
        f"FFN {res.intermediate_before} → {res.intermediate_after} channels, parameters "
        f"{res.params_before / 1e6:,.1f} M → {res.params_after / 1e6:,.1f} M; {res.seconds:.0f} s\n"
        f"wrote {res.out} (measure it: `tokenfab quant eval{base} --candidate {res.out} --speed`)")
    return 0
