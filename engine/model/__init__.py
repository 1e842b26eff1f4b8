"""Model definitions on paged attention: the config every architecture is built from, and a registry.

Only the Llama family is implemented (SmolLM2, Llama 2/3); Qwen2 is the same network with biased
Q/K/V projections and usually untied embeddings, so it is expressed as config flags, not code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

# HF `architectures` / `model_type` names and GGUF `general.architecture` values -> our family name.
_ARCH_ALIASES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "llama": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "qwen2": "qwen2",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" ("linear" | "llama3") and its parameters, HF-style.
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Bias on the Q/K/V projections (Qwen2; Llama with attention_bias).
    attention_bias: bool = False
    # Bias on the output projection: Llama's attention_bias covers it, Qwen2's does not.
    attention_out_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    architecture: str = "llama"
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a parsed HF config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        arch = resolve_architecture(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            rest = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
            scaling = None if rope_type == "default" else {**rest, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
        bias = bool(cfg.get("attention_bias", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            attention_out_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            architecture=arch,
            eos_token_ids=eos_ids,
            name=name,
        )


def resolve_architecture(cfg: dict[str, Any]) -> str:
    """Our family name for an HF config dict; ValueError naming the architecture if unsupported."""
    candidates = list(cfg.get("architectures") or []) + [cfg.get("model_type")]
    for cand in candidates:
        if cand in _ARCH_ALIASES:
            return _ARCH_ALIASES[cand]
    shown = ", ".join(str(c) for c in candidates if c) or "none given"
    raise ValueError(f"unsupported model architecture ({shown}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def architecture_alias(name: str) -> str | None:
    return _ARCH_ALIASES.get(name)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    # Imported here: the model modules import this one for ModelConfig.
    from engine.model.llama import LlamaForCausalLM

    if architecture not in SUPPORTED_ARCHITECTURES:  # every one of them is a LlamaForCausalLM
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return LlamaForCausalLM


__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "get_model_class", "resolve_architecture", "architecture_alias"]
