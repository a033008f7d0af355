"""Loading a model and preparing it to run: checkpoints and GGUF, streamed loads, prepacked linears, CUDA graphs."""
