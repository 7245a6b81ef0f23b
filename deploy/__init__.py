"""Beyond training: a checkpoint exported to ONNX or a torch.export program (export.py), written as a model folder in
the Hugging Face Hub's layout (publish.py), served over HTTP (serve.py); docs/SERVING.md."""

