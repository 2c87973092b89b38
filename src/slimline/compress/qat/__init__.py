"""Quantization-aware training: fake quantization in the deployment format, distillation from
the FP32 teacher, and a QDQ ONNX export that ONNX Runtime runs with INT8 kernels
(:mod:`.fakequant` inserts and exports the fake quantization, :mod:`.step` is the ``qat`` step)."""
