"""Linear-layer shapes (N = out_features, K = in_features) of public model families, derived from the
values in their published config.json (hidden_size, intermediate_size, num_attention_heads,
num_key_value_heads, head_dim), so each (N, K) follows from the config, not typed by hand.

    from model_shapes import model_shapes, distinct_shapes
    model_shapes()                  # [Shape(family, model, role, N, K), ...]
    distinct_shapes(model_shapes()) # {(N, K): [Shape, ...]}
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    family: str
    model: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    fused: bool = False  # qkv_proj and gate_up_proj stored as one weight each (Phi-3, Phi-4)
    falcon: bool = False  # Falcon: fused query_key_value, 4h MLP without a gate


@dataclass(frozen=True)
class Shape:
    family: str
    model: str
    role: str
    N: int
    K: int


# family, model, hidden, intermediate, attention heads, kv heads, head_dim (from each model's config.json)
CONFIGS = [
    Config("llama2", "Llama-2-7B", 4096, 11008, 32, 32, 128),
    Config("llama2", "Llama-2-13B", 5120, 13824, 40, 40, 128),
    Config("llama2", "Llama-2-70B", 8192, 28672, 64, 8, 128),
    Config("llama3", "Llama-3-8B", 4096, 14336, 32, 8, 128),
    Config("llama3", "Llama-3-70B", 8192, 28672, 64, 8, 128),
    Config("mistral", "Mistral-7B", 4096, 14336, 32, 8, 128),
    Config("mistral", "Mixtral-8x7B-expert", 4096, 14336, 32, 8, 128),
    Config("qwen2.5", "Qwen2.5-0.5B", 896, 4864, 14, 2, 64),
    Config("qwen2.5", "Qwen2.5-1.5B", 1536, 8960, 12, 2, 128),
    Config("qwen2.5", "Qwen2.5-3B", 2048, 11008, 16, 2, 128),
    Config("qwen2.5", "Qwen2.5-7B", 3584, 18944, 28, 4, 128),
    Config("qwen2.5", "Qwen2.5-14B", 5120, 13824, 40, 8, 128),
    Config("qwen2.5", "Qwen2.5-32B", 5120, 27648, 40, 8, 128),
    Config("qwen2.5", "Qwen2.5-72B", 8192, 29568, 64, 8, 128),
    Config("gemma2", "Gemma-2-2B", 2304, 9216, 8, 4, 256),
    Config("gemma2", "Gemma-2-9B", 3584, 14336, 16, 8, 256),
    Config("gemma2", "Gemma-2-27B", 4608, 36864, 32, 16, 128),
    Config("gemma3", "Gemma-3-4B", 2560, 10240, 8, 4, 256),
    Config("gemma3", "Gemma-3-12B", 3840, 15360, 16, 8, 256),
    Config("gemma3", "Gemma-3-27B", 5376, 21504, 32, 16, 128),
    Config("phi", "Phi-3-mini", 3072, 8192, 32, 32, 96, fused=True),
    Config("phi", "Phi-4", 5120, 17920, 40, 10, 128, fused=True),
    Config("smollm2", "SmolLM2-135M", 576, 1536, 9, 3, 64),
    Config("smollm2", "SmolLM2-360M", 960, 2560, 15, 5, 64),
    Config("smollm2", "SmolLM2-1.7B", 2048, 8192, 32, 32, 64),
    Config("olmo", "OLMo-7B", 4096, 11008, 32, 32, 128),
    Config("falcon", "Falcon-7B", 4544, 4 * 4544, 71, 1, 64, falcon=True),
]

# DeepSeek-V2-Lite (MLA attention without q LoRA, MoE): hidden 2048, 16 heads, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128, kv_lora_rank 512, moe_intermediate_size 1408, n_shared_experts 2
# (one fused shared MLP of 2 x 1408), intermediate_size 10944 (the dense first layer).
DEEPSEEK_V2_LITE = {
    "hidden": 2048,
    "heads": 16,
    "qk_nope": 128,
    "qk_rope": 64,
    "v_head": 128,
    "kv_lora_rank": 512,
    "moe_inter": 1408,
    "n_shared": 2,
    "dense_inter": 10944,
}


def config_shapes(c: Config) -> list[Shape]:
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    if c.falcon:
        roles = [
            ("qkv", q + 2 * kv, c.hidden),
            ("o", c.hidden, q),
            ("up", c.intermediate, c.hidden),
            ("down", c.hidden, c.intermediate),
        ]
    elif c.fused:
        roles = [
            ("qkv", q + 2 * kv, c.hidden),
            ("o", c.hidden, q),
            ("gate_up", 2 * c.intermediate, c.hidden),
            ("down", c.hidden, c.intermediate),
        ]
    else:
        roles = [
            ("q", q, c.hidden),
            ("kv", kv, c.hidden),
            ("o", c.hidden, q),
            ("gate_up", c.intermediate, c.hidden),
            ("down", c.hidden, c.intermediate),
        ]
    if c.model.startswith("Mixtral"):  # only the expert MLPs (w1/w3, w2): the attention is Mistral-7B's
        roles = [r for r in roles if r[0] in ("gate_up", "down")]
    return [Shape(c.family, c.model, role, N, K) for role, N, K in roles]


def deepseek_shapes() -> list[Shape]:
    d = DEEPSEEK_V2_LITE
    h, m = d["hidden"], "DeepSeek-V2-Lite"
    roles = [
        ("q", d["heads"] * (d["qk_nope"] + d["qk_rope"]), h),
        ("kv_a", d["kv_lora_rank"] + d["qk_rope"], h),
        ("kv_b", d["heads"] * (d["qk_nope"] + d["v_head"]), d["kv_lora_rank"]),
        ("o", h, d["heads"] * d["v_head"]),
        ("expert_gate_up", d["moe_inter"], h),
        ("expert_down", h, d["moe_inter"]),
        ("shared_gate_up", d["n_shared"] * d["moe_inter"], h),
        ("shared_down", h, d["n_shared"] * d["moe_inter"]),
        ("dense_gate_up", d["dense_inter"], h),
        ("dense_down", h, d["dense_inter"]),
    ]
    return [Shape("deepseek", m, role, N, K) for role, N, K in roles]


def model_shapes() -> list[Shape]:
    """Every (family, model, role, N, K); (gate and up share one shape, listed once as gate_up)."""
    out = []
    for c in CONFIGS:
        out += config_shapes(c)
    return out + deepseek_shapes()


def families() -> list[str]:
    return sorted({s.family for s in model_shapes()})


def distinct_shapes(shapes: list[Shape]) -> dict[tuple[int, int], list[Shape]]:
    """(N, K) -> the shapes of that size, in first-seen order."""
    out: dict[tuple[int, int], list[Shape]] = {}
    for s in shapes:
        out.setdefault((s.N, s.K), []).append(s)
    return out


def shape_label(group: list[Shape]) -> str:
    """A short name for one (N, K): its first model and role, and how many others share it."""
    s = group[0]
    return f"{s.model}:{s.role}" + (f"+{len(group) - 1}" if len(group) > 1 else "")


if __name__ == "__main__":
    shapes = model_shapes()
    groups = distinct_shapes(shapes)
    for (N, K), g in groups.items():
        print(f"{N:>6} x {K:<6} {', '.join(f'{s.model}:{s.role}' for s in g)}")
    print(f"{len(shapes)} shapes, {len(groups)} distinct (N, K), {len(families())} families")
