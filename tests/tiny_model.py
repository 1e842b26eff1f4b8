"""Tiny random models for fast tests: an HF directory with config, safetensors and a ChatML tokenizer.

The tokenizer is a byte-level BPE trained in milliseconds on a few sentences, so any text encodes
and decodes losslessly while the vocabulary (and so the model) stays small.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "Hello! How are you today? I am a small language model used only in tests.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "user assistant system: what is the capital of France? Paris is the capital.",
]


def make_tiny_tokenizer(out_dir: Path, vocab_size: int = 320) -> Any:
    """Save a byte-level BPE tokenizer (ids 0-2 are the ChatML specials; eos = <|im_end|>) into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf


def make_tiny_model_dir(tmp_path: Path, arch: Literal["llama", "qwen2"] = "llama", seed: int = 0,
                        **config_overrides: Any) -> Path:
    """Write a tiny random HF model (2 layers, hidden 64, 4 heads / 2 KV heads) and its tokenizer.

    Returns the directory, loadable with engine.loader.load_model and transformers alike.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(tmp_path) / f"tiny-{arch}"
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = make_tiny_tokenizer(out)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    kwargs: dict[str, Any] = dict(
        vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=eos, pad_token_id=hf_tok.pad_token_id,
        # Weights larger than the default init, so logits are far from uniform and greedy choices are stable.
        initializer_range=0.2,
    )
    kwargs.update(config_overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif arch == "qwen2":
        kwargs.setdefault("tie_word_embeddings", False)
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    with torch.no_grad():  # default init zeroes biases: randomize so a test would notice them dropped
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    return out
