"""Weight-only quantization: the exchange format (affine.py) between where quantized weights come from
(quantized at load from a float checkpoint, or read from a pre-quantized one) and the products that run them."""
