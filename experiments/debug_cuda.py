"""Smallest CUDA run of the engine (a SmolLM2-shaped model with random weights): prefill,
decode eager and through graphs. Run with CUDA_LAUNCH_BLOCKING=1 to locate device asserts."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slora import Engine, EngineConfig, SamplingParams  # noqa: E402

model = str(Path(__file__).resolve().parent / "models" / "smollm2-135m")
for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
    e = Engine(EngineConfig(model=model, load_format="dummy", device="cuda", num_pages=64,
                            backend=backend, cuda_graphs=graphs))
    e.add_synthetic_adapter("a", 8)
    outs = e.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4, ignore_eos=True),
                      adapters=["a", None])
    print(backend, graphs, [o.token_ids for o in outs], flush=True)
