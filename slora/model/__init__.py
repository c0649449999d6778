"""The model: one parameterised Llama-family decoder (llama.py), its weights and PEFT adapters
(loader.py), FP8 weights (quant.py) and the embedded default model (smollm.py)."""
