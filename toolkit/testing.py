"""Tiny, offline models and tokenizers for tests, examples and bug reports.

`tiny_tokenizer()` trains a byte-level BPE in milliseconds on a built-in corpus and gives it a
ChatML chat template, so no test needs the network. `tiny_model()` builds a 2-layer, width-64
Llama with random weights from a config. Both are deterministic.
"""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2VLProcessor

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


# ------------------------------------------------------------------------------------------------
# Parity helpers: the same batch in TRL's layout, so a loss (ours or a plugin's) can be compared
# with TRL's trainers on identical inputs.
# ------------------------------------------------------------------------------------------------


def trl_dpo_inputs(examples, pad_token_id: int) -> dict[str, torch.Tensor]:
    """DPO examples (prompt_ids, chosen_ids, rejected_ids) as TRL's DPOTrainer._compute_loss takes them:
    all chosen rows then all rejected rows, right-padded, with attention and completion masks."""
    seqs = [(e["prompt_ids"], e["chosen_ids"]) for e in examples] + [(e["prompt_ids"], e["rejected_ids"])
                                                                     for e in examples]
    T = max(len(p) + len(c) for p, c in seqs)
    input_ids = torch.full((len(seqs), T), pad_token_id)
    attention = torch.zeros((len(seqs), T), dtype=torch.long)
    completion = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        input_ids[i, :len(p) + len(c)] = torch.tensor(list(p) + list(c))
        attention[i, :len(p) + len(c)] = 1
        completion[i, len(p):len(p) + len(c)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def trl_grpo_inputs(prompts, completions, advantages, old_logps, pad_token_id: int, max_completion_length: int,
                    ref_logps=None) -> dict[str, torch.Tensor]:
    """A fixed GRPO batch (token-id lists, per-row old/ref log-prob tensors) in TRL's GRPOTrainer layout:
    left-padded prompts, right-padded completions."""
    B, C, P = len(prompts), max_completion_length, max(len(p) for p in prompts)
    out = {"prompt_ids": torch.full((B, P), pad_token_id), "prompt_mask": torch.zeros((B, P), dtype=torch.long),
           "completion_ids": torch.full((B, C), pad_token_id), "completion_mask": torch.zeros((B, C), dtype=torch.long),
           "advantages": advantages, "old_per_token_logps": torch.zeros((B, C))}
    if ref_logps is not None:
        out["ref_per_token_logps"] = torch.zeros((B, C))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        out["prompt_ids"][i, P - len(p):] = torch.tensor(p)
        out["prompt_mask"][i, P - len(p):] = 1
        out["completion_ids"][i, :len(c)] = torch.tensor(c)
        out["completion_mask"][i, :len(c)] = 1
        out["old_per_token_logps"][i, :len(c)] = old_logps[i]
        if ref_logps is not None:
            out["ref_per_token_logps"][i, :len(c)] = ref_logps[i]
    out["num_items_in_batch"] = out["completion_mask"].sum()
    return out


def fixed_rollout(prompts, completions, advantages, old_logps, group_size: int, ref_logps=None):
    """The same fixed batch as a toolkit GRPO `Rollout` (every row in the loss)."""
    from .core.grpo import Rollout

    B = len(prompts)
    return Rollout(prompt_ids=prompts, completion_ids=completions, sampler_logps=[o.tolist() for o in old_logps],
                   rewards=torch.zeros(B), rewards_per_func=torch.zeros(1, B), advantages=advantages,
                   included=torch.ones(B, dtype=torch.bool),
                   group_ids=torch.arange(B // group_size).repeat_interleave(group_size),
                   truncated=torch.zeros(B, dtype=torch.bool), old_logps=list(old_logps),
                   ref_logps=list(ref_logps) if ref_logps is not None else None)


# ------------------------------------------------------------------------------------------------
# A judge over HTTP on loopback: the latency-bound reward of tests and bench/async_grpo.py
# ------------------------------------------------------------------------------------------------


class JudgeServer:
    """A real HTTP server on 127.0.0.1 that answers `HTTPJudge` requests like a remote LLM judge: it waits a
    latency drawn uniformly from `latency` seconds (seeded) per request, then scores with `numeric_match` on
    the request's `answer` column. `fail_every=k` answers HTTP 503 to every k-th request (flaky judges).

        with JudgeServer(latency=(0.5, 2.0)) as judge:
            trainer = GRPOTrainer(..., reward_funcs=[HTTPJudge(judge.url)])
    """

    def __init__(self, latency: tuple[float, float] = (0.0, 0.0), *, seed: int = 0, fail_every: int = 0):
        import random
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.latency, self.requests, self.fail_every = latency, 0, fail_every
        self.in_flight = self.max_in_flight = 0  # requests being answered at once (now, and the most seen)
        rng, lock, server_ = random.Random(seed), threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                import json

                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with lock:
                    server_.requests += 1
                    n = server_.requests
                    delay = rng.uniform(*server_.latency)
                    server_.in_flight += 1
                    server_.max_in_flight = max(server_.max_in_flight, server_.in_flight)
                try:
                    self._answer(body, n, delay)
                finally:
                    with lock:
                        server_.in_flight -= 1

            def _answer(self, body, n, delay):
                import json
                import time

                from .core.rewards import numeric_match

                time.sleep(delay)
                if server_.fail_every and n % server_.fail_every == 0:
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"judge overloaded")
                    return
                rewards = numeric_match(body["prompts"], body["completions"], None, **body["columns"])
                out = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/score"
        self._thread = threading.Thread(target=self._server.serve_forever, name="toolkit-judge", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
# Tiny vision-language models (random weights, processors built offline): two families with different
# image-token handling, so every vision code path is tested against both.
#   Qwen2-VL: dynamic resolution (an image becomes grid_t*grid_h*grid_w/merge^2 `<|image_pad|>` tokens, so
#             the count depends on the image's size), M-RoPE 3-D positions, pixel patches flattened per batch.
#   Idefics3 (SmolVLM): a fixed number of `<image>` tokens per image between `<fake_token_around_image>`
#             markers, plain 1-D positions, pixel values [batch, images, C, H, W] with a pixel mask.
# ------------------------------------------------------------------------------------------------

# The chat template loops over content parts: {"type": "image"} becomes the family's placeholder, which the
# processor then expands to the image's tokens.
def _vision_chat_template(image_placeholder: str) -> str:
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_placeholder + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def _text_config(tok, hidden_size: int) -> dict:
    return dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                tie_word_embeddings=True)


class _ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor (which needs torchvision): images only. At module level, so
    the processor pickles, as async GRPO's rollout worker needs. (ProcessorMixin reads which sub-processors exist
    from this signature.)"""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        Qwen2VLProcessor.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _seeded(model_class, config, seed: int):
    """A tiny vision-language model of `model_class` with sdpa attention and weights drawn from `seed`."""
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model.config._name_or_path = ""
    return model


def tiny_qwen2_vl(*, seed: int = 0):
    """(model, processor): a Qwen2-VL with a 2-layer width-64 text model and a 2-block vision tower.

    Images are resized to between 56x56 and 112x112 pixels (4 to 16 image tokens each, by size)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    template = _vision_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tok.chat_template = template
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = _ImageOnlyQwen2VLProcessor(image_processor, tok, chat_template=template)
    ids = tok.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={**_text_config(tok, 64),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    return _seeded(Qwen2VLForConditionalGeneration, config, seed), processor


def tiny_llava_next(*, seed: int = 0):
    """(model, processor): a LLaVA-NeXT (any-resolution: each image is cut into 28x28 crops on the best of a
    2x1, 1x2 or 2x2 grid, plus a downscaled whole view; `pixel_values` is [images, crops, C, H, W]) with a 2-layer
    width-64 Llama text model and a 2-layer CLIP tower; an image is 10 to 20 `<image>` tokens, by its shape."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = tiny_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    template = _vision_chat_template("<image>")
    tok.chat_template = template
    grid = [[28, 56], [56, 28], [56, 56]]
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                 image_grid_pinpoints=grid)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=template)
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=28, patch_size=14, projection_dim=32),
        text_config={**_text_config(tok, 64), "model_type": "llama"}, image_grid_pinpoints=grid,
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=True,
    )
    return _seeded(LlavaNextForConditionalGeneration, config, seed), processor


def tiny_idefics3(*, seed: int = 0):
    """(model, processor): an Idefics3 (SmolVLM's family) with a 2-layer width-64 Llama text model and a
    2-layer SigLIP vision tower on 56x56 images; each image is 4 `<image>` tokens (no image splitting)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = tiny_tokenizer()
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 56},
                                                do_image_splitting=False)
    template = _vision_chat_template("<image>")
    tok.chat_template = template
    # The processor adds its tokens (<fake_token_around_image>, <image>, <end_of_utterance>) to the tokenizer.
    processor = Idefics3Processor(image_processor, tok, image_seq_len=4, chat_template=template)
    tok.add_tokens(["<global-img>"], special_tokens=True)
    config = Idefics3Config(
        text_config={**_text_config(tok, 64), "model_type": "llama"},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14),
        scale_factor=2, image_token_id=processor.image_token_id, tie_word_embeddings=True,
    )
    return _seeded(Idefics3ForConditionalGeneration, config, seed), processor
