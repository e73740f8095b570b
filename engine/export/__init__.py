"""Export: the decode step as ONNX."""
