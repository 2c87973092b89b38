"""Compression steps: graph optimization, quantization, pruning, fine-tuning, QAT."""
