"""One config class for every member of the K3 family (k3-mini, k3-slice, Kimi K3)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass
class K3Config:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 8
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    max_position_embeddings: int = 4096
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    attn_res_block_size: int = 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 768
    # KDA (layer lists 1-based, as in K3)
    kda_layers: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 6, 7])
    full_attn_layers: list[int] = field(default_factory=lambda: [4, 8])
    kda_num_heads: int = 2
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    gate_low_rank_dim: int = 128
    # MLA
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    # LatentMoE
    num_experts: int = 32
    num_experts_per_token: int = 4
    moe_intermediate_size: int = 256
    num_shared_experts: int = 1
    shared_expert_intermediate_size: int = 512
    routed_expert_hidden_size: int = 128
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    mxfp4_group_size: int = 32

    # ---- derived -------------------------------------------------------------------------
    def is_kda(self, layer: int) -> bool:
        return (layer + 1) in self.kda_layers

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) in self.full_attn_layers

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    def validate(self) -> None:
        for l in range(self.num_hidden_layers):
            if self.is_kda(l) == self.is_mla(l):
                raise ValueError(f"layer {l}: must be exactly one of KDA / MLA")
        if self.routed_expert_hidden_size % self.mxfp4_group_size or self.moe_intermediate_size % self.mxfp4_group_size:
            raise ValueError("expert dims must be multiples of the MXFP4 group size")

    # ---- K3-style config.json ------------------------------------------------------------
    def to_hf(self) -> dict:
        return {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "situ",
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "intermediate_size": self.intermediate_size,
            "linear_attn_config": {
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "gate_lower_bound": self.gate_lower_bound,
                "use_full_rank_gate": True,
                "gate_low_rank_dim": self.gate_low_rank_dim,
            },
            "num_attention_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": True,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "topk_method": "noaux_tc",
            "num_expert_group": 1,
            "topk_group": 1,
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "group_size": self.mxfp4_group_size,
                "targets": ["routed_experts"],
            },
        }

    @classmethod
    def from_hf(cls, d: dict) -> "K3Config":
        la = d["linear_attn_config"]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            rms_norm_eps=d["rms_norm_eps"], bos_token_id=d["bos_token_id"], eos_token_id=d["eos_token_id"],
            pad_token_id=d["pad_token_id"], max_position_embeddings=d["max_position_embeddings"],
            activation_situ_beta=d["activation_situ_beta"],
            activation_situ_linear_beta=d["activation_situ_linear_beta"],
            attn_res_block_size=d["attn_res_block_size"], first_k_dense_replace=d["first_k_dense_replace"],
            intermediate_size=d["intermediate_size"], kda_layers=list(la["kda_layers"]),
            full_attn_layers=list(la["full_attn_layers"]), kda_num_heads=la["num_heads"], kda_head_dim=la["head_dim"],
            short_conv_kernel_size=la["short_conv_kernel_size"], gate_lower_bound=la["gate_lower_bound"],
            gate_low_rank_dim=la["gate_low_rank_dim"], num_attention_heads=d["num_attention_heads"],
            q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"], num_experts=d["num_experts"],
            num_experts_per_token=d["num_experts_per_token"], moe_intermediate_size=d["moe_intermediate_size"],
            num_shared_experts=d["num_shared_experts"],
            shared_expert_intermediate_size=d.get(
                "shared_expert_intermediate_size", d["num_shared_experts"] * d["moe_intermediate_size"]),
            routed_expert_hidden_size=d["routed_expert_hidden_size"],
            routed_scaling_factor=d["routed_scaling_factor"], moe_renormalize=d["moe_renormalize"],
            mxfp4_group_size=d["quantization_config"]["group_size"],
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_hf(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "K3Config":
        with open(path) as f:
            return cls.from_hf(json.load(f))

    def replace(self, **kw) -> "K3Config":
        return dataclasses.replace(self, **kw)


def k3_mini() -> K3Config:
    """The embedded default (docs/k3-model.md §1, k3-mini)."""
    return K3Config()


def k3_slice() -> K3Config:
    """K3's exact per-layer shapes with 8 layers, for one-GPU kernel benchmarks (dummy weights)."""
    return K3Config(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=8, attn_res_block_size=4,
        intermediate_size=33792, kda_num_heads=96, kda_head_dim=128, gate_low_rank_dim=128,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=128, num_experts_per_token=16, moe_intermediate_size=3072,
        num_shared_experts=2, shared_expert_intermediate_size=6144, routed_expert_hidden_size=3584,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, max_position_embeddings=1048576,
    )


def kimi_k3() -> K3Config:
    """The published Kimi K3 text decoder shapes (docs/k3-model.md §1)."""
    full = [4 * i for i in range(1, 24)] + [93]
    return k3_slice().replace(
        num_hidden_layers=93, attn_res_block_size=12, num_experts=896,
        kda_layers=[l for l in range(1, 94) if l not in full], full_attn_layers=full,
    )
