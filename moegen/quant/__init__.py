"""Quantized experts: the weight formats (formats), a round-to-nearest quantizer and the
dequantization the float64 reference uses (quantize), and the readers of quantized checkpoints'
layouts (checkpoint)."""
