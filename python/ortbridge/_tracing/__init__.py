"""What the exporter and training share: the eager record of a model's calls (record.py), Function
facts (functions.py), the interception of Function.apply (interception.py), the Function call as
a node (nodes.py: attributes, naming), and the fallback that runs in PyTorch the operators torch's
ONNX exporter cannot write (fallback.py) or ONNX Runtime has no kernel for (kernels.py)."""
