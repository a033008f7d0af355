"""What `--quantize int4` means, in a module without torch (the job fingerprint, jobs/durability/fingerprint.py,
records INT4_RECIPE before anything is loaded).

Asymmetric int4 (min/max) in groups of INT4_GROUP_SIZE input channels, except the layers named in
INT4_COARSE_LAYERS, in groups of INT4_COARSE_GROUP_SIZE where their input width allows it; the same
on torchao and quanto. On the embedded SmolLM2-135M (benchmarks/int4_recipes.py; the table is in
docs/quantization.md), teacher-forced top-1 agreement with the bf16 model's greedy tokens:
groups of 64 everywhere 73-78%, groups of 32 everywhere 97-98%. Part of that is the embedded
checkpoint: a GGUF Q4_1 (blocks of 32 input channels with a scale and a minimum), whose grid min/max
groups of 32 land back on; finer groups also fit any model's outliers better.

Groups of 32 everywhere weigh 0.353x bf16's bytes with the int8 embedding (a bf16 scale and zero
per 32 weights), over the issue's 0.35x target. One of the three MLP projections in groups of 64
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

# --quantize int8 on oneDNN (engine/quant/int8.py). The default recipe is the one that meets 97%
# teacher-forced top-1 agreement with bf16's greedy tokens on the full quality set (8 documents + 64
# ShareGPT prompts, benchmarks/quality.py; benchmarks/results/2026-12-02-int8-recipes.md): 3% outlier
# channels, no smoothing, per-token asymmetric activations into down_proj: 97.3 / 97.3%. A faster
# recipe (smoothing 0.5, no outliers) kept only 94.7 / 95.1%; a quantization that changes one greedy
# token in twenty is not a safe default.
# SmoothQuant's migration strength for the per-input-channel smoothing (engine/quant/smooth.py),
# from a calibration pass on fixed text; None: no smoothing. Alone it raised top-1 from ~93% to
# ~95% (alpha 0.5 gave the lowest KL of 0.4-0.8); with outlier channels it only costs agreement.
INT8_SMOOTH_ALPHA: float | None = None
# per layer type (child name; a stacked set goes by its first child, q_proj or gate_proj): another alpha
INT8_SMOOTH_ALPHA_BY_LAYER: dict[str, float] = {}
# LLM.int8()-style outlier decomposition (engine/quant/outliers.py): this share of each layer's
# input channels, the widest in the calibration pass, computed in the model dtype outside the int8
# matmul; 0: none. 0.03 (with no smoothing and an asymmetric down_proj) is the smallest share that
# met 97% top-1 at full size (97.3 / 97.3%; 0.05: 97.3 / 97.7%; 0.02: 96.1 / 96.8%); each outlier
# channel is extra bf16 work in every call, so fewer is faster
INT8_OUTLIER_FRACTION = 0.03
# the layers (child names; a stacked set by any of its children) that take it; empty: every quantized layer
INT8_OUTLIER_LAYERS: tuple[str, ...] = ()
# per layer type (child name; a stacked set by the first of its children named here): another share
INT8_OUTLIER_FRACTION_BY_LAYER: dict[str, float] = {}
# linear layers (child names) --quantize int8 on oneDNN leaves in full precision: none by default.
# ("down_proj",) was tried (benchmarks/results/2026-12-02-int8-recipes.md): its inputs, SiLU(gate) * up, lose
# the most to per-token int8 (~3% relative output error in every layer, against ~2% elsewhere)
INT8_FULL_PRECISION_LAYERS: tuple[str, ...] = ()
# the LM head through the same oneDNN int8 x int8 matmul (when the embedding/LM head is not
# --quantize-embedding int8): off. It is faster end to end but costs top-1 agreement, and with
# outlier channels of its own (which keep 97.1 / 97.5%) the head's outliers cost more time than the
# int8 head saves (benchmarks/results/2026-12-02-int8-recipes.md)
INT8_LM_HEAD = False
# q/k/v and gate/up of a layer as one stacked int8 matmul each (engine/quant/int8_siblings.py);
# with smoothing, a stacked set shares one factor per input channel
INT8_STACK_SIBLINGS = True
# layers (child names; a stacked set by any of its children) with per-token asymmetric activations
# (a zero point per token, engine/quant/int8.py) instead of symmetric ones
INT8_ASYMMETRIC_LAYERS: tuple[str, ...] = ("down_proj",)
# what the job fingerprint records for int8: a job begun under another recipe refuses to resume
INT8_RECIPE = ",".join(["per-token", *([f"smooth-a{INT8_SMOOTH_ALPHA}"] if INT8_SMOOTH_ALPHA is not None else []),
                        *(f"{name}:smooth-a{a}" for name, a in sorted(INT8_SMOOTH_ALPHA_BY_LAYER.items())),
                        *([f"outliers-{INT8_OUTLIER_FRACTION}"] if INT8_OUTLIER_FRACTION > 0 else []),
                        *(f"{name}:outliers" for name in INT8_OUTLIER_LAYERS if INT8_OUTLIER_FRACTION > 0),
                        *(f"{name}:outliers-{f}" for name, f in sorted(INT8_OUTLIER_FRACTION_BY_LAYER.items())),
                        *(f"{name}:asym" for name in INT8_ASYMMETRIC_LAYERS),
                        *(["stacked"] if INT8_STACK_SIBLINGS else []),
                        *(f"{name}:full" for name in INT8_FULL_PRECISION_LAYERS),
                        *(["lm_head"] if INT8_LM_HEAD else [])])
