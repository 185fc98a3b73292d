"""Write a seeded tiny model in the Hub layout, of any supported family:

    python -m fv_accel.tiny_model DIR [--model NAME] [--seed 0]
    python -m fv_accel.tiny_model --list

The Wan variants are `fv_accel.tiny.model`'s; other families' come from their own tiny modules
(`fv_accel.tiny.registry`); this command reaches them through the tiny world's door, `fv_accel.tiny`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from fv_accel.tiny import tiny_model_defaults, tiny_models


def list_lines() -> list[str]:
    models = tiny_models()
    width = max(len(n) for n in models)
    return [f"{name:<{width}}  {m.layout.split('/')[-1].removesuffix('-Diffusers')} layout: {m.summary}" for name, m in models.items()]


def main(argv: Optional[list[str]] = None) -> None:
    models = tiny_models()
    default_model, class_aliases = tiny_model_defaults()
    from fv_accel.process import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m fv_accel.tiny_model", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", help="folder to write the model to")
    parser.add_argument("--model", choices=list(models), default=None, help=f"which model (default: {default_model}; --list)")
    parser.add_argument("--class", dest="model_class", choices=list(class_aliases), default=None,
                        help="older spelling: wan = --model wan21_t2v, skyreels_v2 = --model skyreels_v2")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--list", action="store_true", help="print the models, one a line, and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(list_lines()))
        return
    if args.out_dir is None:
        parser.error("the folder to write (DIR) is required unless --list is given")
    name = args.model or class_aliases.get(args.model_class or "", default_model)
    if args.model and args.model_class and class_aliases[args.model_class] != args.model:
        parser.error(f"--class {args.model_class} and --model {args.model} name different models; give one")
    path = models[name].write(Path(args.out_dir), args.seed)
    print(f"wrote the tiny {name} model ({models[name].layout} layout) to {path}")


if __name__ == "__main__":
    main()
