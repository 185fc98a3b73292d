"""The built-in tiny world: seeded tiny models in the Hub layout and the tiny clip dataset.

It sits above preprocessing (the tiny dataset is made by the real preprocessing pipeline) and
below `build` and validation, which use it for the `tiny` data path.
"""
