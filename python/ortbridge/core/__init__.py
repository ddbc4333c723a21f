"""What the exporter and training share: the Function call as a node (attributes, naming), the
eager record of a model's calls, the interception of Function.apply, and the fallback that runs
operators torch's ONNX exporter cannot write (or ONNX Runtime has no kernel for: kernels) in PyTorch."""
