"""Weight quantization: what a --quantize choice resolves to, and the modules that replace linear layers."""
