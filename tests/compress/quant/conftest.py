from quant_fixtures import cnn_onnx, encoder_onnx

__all__ = ["cnn_onnx", "encoder_onnx"]
