"""`python -m fv_accel.tiny_model DIR`: write a seeded tiny model in the Hub layout (see
`fv_accel.tiny.model`)."""

from fv_accel.tiny.model import main, write_tiny_model  # noqa: F401 (the public entry points)

if __name__ == "__main__":
    main()
