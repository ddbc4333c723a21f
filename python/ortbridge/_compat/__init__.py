"""Every private torch (torch_private.py) and onnxruntime (ort_private.py) API the package uses,
with a branch where releases differ."""
