"""What `--quantize int4` means, in a module without torch (the job fingerprint, jobs/durability/fingerprint.py,
records INT4_RECIPE before anything is loaded).

Asymmetric int4 (min/max) in groups of INT4_GROUP_SIZE input channels, except the layers named in
INT4_COARSE_LAYERS, in groups of INT4_COARSE_GROUP_SIZE where their input width allows it; the same
on torchao and quanto. Measured on the embedded SmolLM2-135M (benchmarks/quant/int4_recipes.py, the
README's quantization table), teacher-forced top-1 agreement with the bf16 model's greedy tokens:
groups of 64 everywhere 73-78%, groups of 32 everywhere 97-98%. Part of that is the embedded
checkpoint: a GGUF Q4_1 (blocks of 32 input channels with a scale and a minimum), whose grid min/max
groups of 32 land back on; finer groups also fit any model's outliers better.

Groups of 32 everywhere weigh 0.353x bf16's bytes with the int8 embedding (a bf16 scale and zero
per 32 weights), over the 0.35x target. One of the three MLP projections in groups of 64
(26.5M of SmolLM2's 106M linear weights at 1/16 byte less each) makes 0.346x; which one matters
(8 docs + 48 ShareGPT prompts, 64 tokens): gate_proj keeps ~94% top-1, up_proj less, down_proj
(tried on the small set) only ~87-88%, under the 90% target. So the MLP's gate projections are in
groups of 64.
"""

INT4_GROUP_SIZE = 32  # torchao's CPU int4 kernel takes 32..256
INT4_COARSE_GROUP_SIZE = 64
INT4_COARSE_LAYERS: tuple[str, ...] = ("gate_proj",)  # child names of nn.Linear modules
# what the job fingerprint records for int4: a job begun under another recipe refuses to resume
INT4_RECIPE = ",".join([f"g{INT4_GROUP_SIZE}", *(f"{n}:g{INT4_COARSE_GROUP_SIZE}" for n in INT4_COARSE_LAYERS)])

# --quantize int8 on oneDNN (engine/quant/int8.py, applied by engine/quant/int8_model.py): per-token
# int8 activations, LLM.int8()-style outlier channels, per-token asymmetric activations into
# down_proj, and each layer's q/k/v and gate/up as one stacked matmul. It is the recipe that met the
# 97% teacher-forced top-1 agreement with bf16's greedy tokens on the full quality set (8 documents
# + 64 ShareGPT prompts, benchmarks/README.md): a quantization that changes
# one greedy token in twenty is not a safe default. SmoothQuant-style smoothing only costs agreement
# once the outlier channels are out, so it is not offered; neither are switches no flag would set
# (per-layer overrides, layers left in full precision, an int8 LM head, unstacked siblings): their
# measurements are in benchmarks/README.md.
# The share of each quantized layer's input channels, the widest in the calibration pass
# (engine/quant/calibration.py), computed in the model dtype outside the int8 matmul
# (engine/quant/outliers.py): 2% fell under 97%, 5% cost speed for little more agreement
INT8_OUTLIER_FRACTION = 0.03
# unstacked layers (child names) with per-token asymmetric activations (a zero point per token,
# engine/quant/int8.py) instead of symmetric ones: down_proj's input, SiLU(gate) * up, leans to one
# side; the stacked q/k/v and gate/up sets stay symmetric
INT8_ASYMMETRIC_LAYERS: tuple[str, ...] = ("down_proj",)
# what the job fingerprint records for int8: a job begun under another recipe refuses to resume.
# tests/jobs/durability/test_fingerprint.py pins the string: jobs begun before the unused switches
# were removed still resume
INT8_RECIPE = ",".join(["per-token", f"outliers-{INT8_OUTLIER_FRACTION}",
                        *(f"{name}:asym" for name in INT8_ASYMMETRIC_LAYERS), "stacked"])
