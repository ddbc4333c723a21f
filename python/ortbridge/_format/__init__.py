"""The node format's values: element types (dtypes.py) and constants as JSON (literals.py)."""
