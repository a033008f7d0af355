"""Per-row LoRA adapters: read PEFT adapters, wrap the projections they target (engine/lora/layers.py)."""
