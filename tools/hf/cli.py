"""xhc-convert: zoo checkpoints to Hugging Face ``transformers`` and back (docs/conversion.md).

::

    python -m tools.convert_checkpoint to-hf --run runs/X --output hf/X              # newest checkpoint
    python -m tools.convert_checkpoint to-hf --checkpoint runs/X/checkpoints/step_00000300 --output hf/X --dtype fp32
    python -m tools.convert_checkpoint from-hf --hf hf/X --output runs/X-back          # continue pre-training
    python -m tools.convert_checkpoint from-hf --hf hf/vanilla --to-variant xhc --output runs/upcycled
    python -m tools.convert_checkpoint convert --run runs/vanilla --to-variant mhc --output runs/upcycled

``to-hf`` reads checkpoints of any TP / SP / EP / PP / VPP layout and streams them layer by layer.
Vanilla models (``variant: none``) become native ``Glm4MoeForCausalLM`` folders; every
hyper-connection variant becomes an ``XHCMoeForCausalLM`` folder with its remote code.  ``from-hf``
writes a ``dist_checkpointing`` checkpoint that training loads under any TP / EP / PP; resume it with
``model.preset=<output>/preset.yaml:<variant> checkpoint.load=<output>/checkpoints
checkpoint.load_optimizer=false checkpoint.load_rng=false``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from tools._cli import run_main
from training.run import cpu_entry_point, set_omp_wait_policy  # as training.pretrain
from xhc.config import VARIANTS as ALL_VARIANTS

set_omp_wait_policy()

VARIANTS = tuple(v for v in ALL_VARIANTS if v != "none")  # the hyper-connection variants


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="xhc-convert", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("::")[1])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("to-hf", help="dist_checkpointing checkpoint -> Hugging Face folder")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory (its newest checkpoint)")
    src.add_argument("--checkpoint", help="one checkpoint directory, runs/X/checkpoints/step_N")
    t.add_argument("--output", "-o", required=True, help="the Hugging Face folder to write")
    t.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="weights dtype (default bf16; hyper-connection tensors and the router stay fp32)")
    t.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    t.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--tokenizer", metavar="PATH", help="where the run's tokenizer is now, if not at the path its "
                   "run record names (the same tokenizer: its hash is checked)")

    f = sub.add_parser("from-hf", help="Hugging Face folder -> dist_checkpointing checkpoint (optionally upcycled)")
    f.add_argument("--hf", required=True, help="Hugging Face folder (ours, or a GLM-4.5-MoE model)")
    f.add_argument("--output", "-o", required=True, help="directory for checkpoints/, preset.yaml, config.yaml")
    f.add_argument("--to-variant", choices=VARIANTS, help="upcycle a vanilla model to this hyper-connection variant")
    f.add_argument("--hc", nargs="*", default=[], metavar="key=value", help="HCConfig overrides for --to-variant, e.g. n=4")
    f.add_argument("--overwrite", action="store_true")
    f.add_argument("--quiet", action="store_true")

    e = sub.add_parser("estimate", help="peak memory of to-hf for a preset, from a meta-device model")
    e.add_argument("--preset", required=True, help="e.g. moe-18b:xhc")
    e.add_argument("--vocab-size", type=int, default=None, help="default: the preset's (padded to 128)")
    e.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    e.add_argument("--max-shard-size", default="5GB")

    c = sub.add_parser("convert", help="checkpoint -> checkpoint through Hugging Face (e.g. --to-variant upcycling)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--run")
    src.add_argument("--checkpoint")
    c.add_argument("--output", "-o", required=True)
    c.add_argument("--to-variant", choices=VARIANTS)
    c.add_argument("--hc", nargs="*", default=[], metavar="key=value")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--tokenizer", metavar="PATH", help="as for to-hf")
    return p.parse_args(argv)


def _overrides(items):
    import yaml

    from tools.hf.conversion import ConversionError

    out = {}
    for item in items:
        if "=" not in item:
            raise ConversionError(f"--hc {item!r}: use key=value, e.g. n=4")
        k, v = item.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def main(argv=None) -> int:
    with cpu_entry_point():
        return _main(argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message="Apex is not installed")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from tools.hf import conversion as C

    def body() -> None:
        if args.command == "to-hf":
            src = C.resolve_source(args.run, args.checkpoint, args.tokenizer)
            rep = C.to_hf(src, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                          overwrite=args.overwrite, progress=not args.quiet)
            print(f"[xhc-convert] {src.checkpoint} -> {rep.output}: {rep.architecture}, {rep.parameters:,} parameters "
                  f"(HC {rep.hc_parameters:,}), {rep.bytes_written / 1e6:.1f} MB in {rep.seconds:.1f}s")
            import resource

            print(f"[xhc-convert] memory: largest tensor group {rep.max_group_bytes / 1e6:.2f} MB, largest shard "
                  f"buffer {rep.max_shard_buffer_bytes / 1e6:.2f} MB, process peak RSS "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
            print(f"[xhc-convert] load: AutoModelForCausalLM.from_pretrained({rep.output!r}"
                  f"{'' if rep.native else ', trust_remote_code=True'})")
        elif args.command == "estimate":
            from models.zoo import ZooError, load_preset

            try:
                preset = load_preset(args.preset)
            except ZooError as e:
                raise C.ConversionError(str(e)) from None
            vocab = args.vocab_size or -(-preset.vocab_size // 128) * 128
            est = C.estimate_memory(preset, vocab, preset.seq_length, args.dtype, args.max_shard_size)
            print(f"[xhc-convert] {args.preset}: {est['parameters'] / 1e9:.2f}B parameters in {est['groups']} groups; "
                  f"largest group {est['largest_group']} = {est['largest_group_fp32_bytes'] / 1e9:.2f} GB fp32; "
                  f"to-hf peak tensor memory ≈ {est['peak_bytes'] / 1e9:.2f} GB (group fp32 + {args.dtype} copy + one "
                  f"{args.max_shard_size} shard) vs {est['full_model_fp32_bytes'] / 1e9:.1f} GB for the whole model")
        elif args.command == "from-hf":
            res = C.from_hf(args.hf, args.output, args.to_variant, _overrides(args.hc), args.overwrite,
                            progress=not args.quiet)
            _print_resume(res)
        else:
            src = C.resolve_source(args.run, args.checkpoint, args.tokenizer)
            if os.path.exists(args.output) and not args.overwrite:
                raise C.ConversionError(f"--output {args.output} already exists: choose another folder or pass --overwrite")
            with tempfile.TemporaryDirectory(prefix="xhc-convert-") as tmp:
                C.to_hf(src, os.path.join(tmp, "hf"), dtype="fp32", progress=not args.quiet)
                res = C.from_hf(os.path.join(tmp, "hf"), args.output, args.to_variant, _overrides(args.hc),
                                args.overwrite, progress=not args.quiet)
            _print_resume(res)

    return run_main(body, C.ConversionError)


def _print_resume(res: dict) -> None:
    print(f"[xhc-convert] wrote {res['checkpoint']} (step {res['step']})")
    print(f"[xhc-convert] continue pre-training: python -m training.pretrain model.preset={res['preset']} "
          f"checkpoint.load={os.path.dirname(res['checkpoint'])} checkpoint.load_optimizer=false "
          f"checkpoint.load_rng=false ...")


if __name__ == "__main__":
    sys.exit(main())
