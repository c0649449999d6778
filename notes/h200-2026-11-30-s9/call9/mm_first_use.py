"""Session 9, call 9: host time of F.linear's first call at a new row count, Llama-2-7B shapes.
Is S2's eager-step stall (aten::mm holding the host ~1-2 ms a call in the no-LoRA row's first
eager steps, call 8) paid once per exact row count, or once per cuBLAS kernel choice?"""
import random
import time

import torch
import torch.nn.functional as F

dev = torch.device("cuda")
shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
ws = {k: torch.randn(n, k_, device=dev, dtype=torch.bfloat16) for k, (n, k_) in shapes.items()}
x = torch.randn(8192, 11008, device=dev, dtype=torch.bfloat16)


def host_ms(M):
    """ms of host time of one call per shape at M rows (the device drained before each)."""
    out = []
    for k, w in ws.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.linear(x[:M, :w.shape[1]], w)
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return out


host_ms(64)  # cuBLAS handle, workspace
rng = random.Random(0)
fresh = rng.sample(range(2049, 8193), 40)
print("first call at new M (ms, qkv/o/gate_up/down) | second call at the same M")
for M in fresh[:10]:
    a, b = host_ms(M), host_ms(M)
    print(f"M={M:5d}: " + " ".join(f"{v:6.2f}" for v in a) + " | " + " ".join(f"{v:5.2f}" for v in b))
t0 = time.perf_counter()
for M in range(2048, 8193, 128):
    host_ms(M)
print(f"warmed every 128th M from 2048 to 8192 in {time.perf_counter() - t0:.1f} s")
print("then first calls at new M:")
for M in fresh[10:25]:
    a = host_ms(M)
    print(f"M={M:5d}: " + " ".join(f"{v:6.2f}" for v in a))
