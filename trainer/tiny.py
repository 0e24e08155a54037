"""A tiny Qwen2-style model and a character-level tokenizer, built in code (nothing downloaded).

Used by `manage.py train_demo`, the trainer tests and the GRPO benchmark: the same code path as a
real job (a `Qwen2ForCausalLM` and a `PreTrainedTokenizerFast`), small enough for CPU.

    model, tokenizer = build_tiny(seed=0)
    save_tiny(model, tokenizer, "var/tiny")       # save_pretrained: weights + configs
    model, tokenizer = load_tiny("var/tiny")      # from_pretrained, offline
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD = "<|pad|>"
EOS = "<|endoftext|>"  # Qwen's end-of-text token name
UNK = "<|unk|>"
# One token per character: digits first (so "3" is a low id, easy to read in debugging), then
# lowercase letters and a little punctuation. Enough for arithmetic, words and short JSON.
CHARS = string.digits + string.ascii_lowercase + " +-*=?:,.'\"{}[]_"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: every character in CHARS is one token."""
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split into single characters (spaces included); Fuse joins them back without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        padding_side="left",  # prompts are left-padded for batched generation
        model_max_length=256,
    )


def tiny_config(vocab_size: int, *, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_positions: int = 128) -> Qwen2Config:
    """Qwen2 architecture (GQA, RoPE, SwiGLU, RMSNorm) with toy dimensions."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        use_cache=True,
    )


def build_tiny(seed: int = 0, **dims: int) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Random-init tiny model (seeded, so the same seed gives the same weights) + tokenizer."""
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), **dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def save_tiny(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast,
              path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tiny(path: str | Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    path = Path(path)
    model = Qwen2ForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return model, tokenizer
