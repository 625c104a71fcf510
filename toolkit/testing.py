"""Tiny, offline models and tokenizers for tests, examples and bug reports.

`tiny_tokenizer()` trains a byte-level BPE in milliseconds on a built-in corpus and gives it a
ChatML chat template, so no test needs the network. `tiny_model()` builds a 2-layer, width-64
Llama with random weights from a config. Both are deterministic.
"""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "What is 12 + 7? Answer with just the number.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests; it knows digits 0123456789 and + - * / = ( ) .",
    "user assistant system tool You are a helpful assistant. Please answer the question.",
    "Reply, prompt, completion, chosen, rejected, text, messages: the words of our data formats.",
] * 4


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 384, *, pad_equals_eos: bool = True, chat_template: bool = True):
    """A byte-level BPE tokenizer with ChatML special tokens; eos is `<|im_end|>` as in SmolLM2.

    pad_equals_eos=True reproduces the common (and bug-prone) setting where padding uses the EOS id.
    """
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)))
    tok.eos_token = "<|im_end|>"
    tok.bos_token = None
    tok.pad_token = "<|im_end|>" if pad_equals_eos else "<|endoftext|>"
    if chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_model(vocab_size: int = 384, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
               tie_word_embeddings: bool = True, attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """A 2-layer, width-64 Llama with random weights (deterministic for a given seed)."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None, eos_token_id=2, pad_token_id=2,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = ""
    return model
