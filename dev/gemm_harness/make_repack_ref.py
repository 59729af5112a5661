"""Write PyTorch-reference repack outputs for `harness repackcheck DIR` (bit-exactness of the CUDA repack)."""
import importlib.util
import sys

import torch

spec = importlib.util.spec_from_file_location("tl", "bitsandbytes_kbit/backends/default/tiled_layout.py")
tl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tl)
out = sys.argv[1]
g = torch.Generator().manual_seed(0)
for k in (2, 3, 4, 5):
    for N, K in ((16, 128), (17, 160), (40, 576)):
        nb = N * K // 32
        packed = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64, generator=g).to(torch.int32)
        absu8 = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
        Bp, Ba = tl.repack_kbit_reference(packed, absu8, k, N, K)
        p2, a2 = tl.unrepack_kbit_reference(Bp, Ba, k, N, K)
        assert torch.equal(p2, packed) and torch.equal(a2, absu8), (k, N, K)
        for name, t in (("flat", packed), ("abs", absu8), ("ref", Bp), ("refabs", Ba)):
            t.numpy().tofile(f"{out}/tl_{name}_k{k}_{N}_{K}.bin")
print("wrote reference repack files; python round trip ok")
