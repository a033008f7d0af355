"""What `--quantize int4` means, in a module without torch (the job fingerprint, jobs/fingerprint.py,
records INT4_RECIPE before anything is loaded).

Asymmetric int4 (min/max) in groups of INT4_GROUP_SIZE input channels, except the layers named in
INT4_COARSE_LAYERS, in groups of INT4_COARSE_GROUP_SIZE where their input width allows it; the same
on torchao and quanto. Measured on the embedded SmolLM2-135M (benchmarks/quality.py, the README's
quantization table): groups of 64 everywhere agreed with the bf16 model on 73-78% of greedy tokens,
groups of 32 on 97-98%. Part of that is the embedded checkpoint: a GGUF Q4_1 (blocks of 32 input
channels with a scale and a minimum), whose grid min/max groups of 32 land back on; finer groups
also fit any model's outliers better. The price: groups of 32 everywhere weigh 0.353x bf16's bytes
with the int8 embedding (bf16 scale and zero per 32 weights), just over the 0.35x target. Putting
the MLP's gate projections in groups of 64 (INT4_COARSE_LAYERS = ("gate_proj",)) would bring that
to 0.346x (26.5M of SmolLM2's 106M linear weights at 1/16 byte less each); its quality is not
measured yet, so the default keeps every layer in groups of 32.
"""

INT4_GROUP_SIZE = 32  # torchao's CPU int4 kernel takes 32..256
INT4_COARSE_GROUP_SIZE = 64
INT4_COARSE_LAYERS: tuple[str, ...] = ()  # child names of nn.Linear modules, e.g. ("gate_proj",)
# what the job fingerprint records for int4: a job begun under another recipe refuses to resume
INT4_RECIPE = ",".join([f"g{INT4_GROUP_SIZE}", *(f"{n}:g{INT4_COARSE_GROUP_SIZE}" for n in INT4_COARSE_LAYERS)])
