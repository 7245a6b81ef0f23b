"""Beyond training: a checkpoint exported to ONNX or TorchScript (export.py), written as a model folder in the Hugging
Face Hub's layout (publish.py), served over HTTP (serve.py); docs/SERVING.md."""
