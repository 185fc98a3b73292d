"""`python -m fv_accel.tiny_model DIR [--model NAME]`: write a seeded tiny model in the Hub layout;
`--list` names the variants (see `fv_accel.tiny.model`)."""

from fv_accel.tiny.model import TINY_MODELS, main, write_tiny_model, write_tiny_variant  # noqa: F401 (the public entry points)

if __name__ == "__main__":
    main()
