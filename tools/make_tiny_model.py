"""Make a small, randomly initialised Hugging Face causal LM and a locally trained tokenizer (no network).

    python tools/make_tiny_model.py --arch llama --out runs/tiny-llama
    python tools/make_tiny_model.py --arch qwen3 --out /tmp/q3 --num-key-value-heads 1 --tie-word-embeddings
    python tools/make_tiny_model.py --arch qwen3_moe --out /tmp/q3moe --num-experts 8 --num-experts-per-tok 2

The result is deterministic for a seed: the same flags write bit-identical weights and the same tokenizer.
Norm weights and biases are randomised too (not left at 1 / 0), so that a mapping that swaps or drops them
changes the logits.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_WORDS = ("the answer is what plus minus times equals number sum result compute solve step first then use "
          "each exactly once target reach make from numbers question think final because so we get Sort digits "
          "Use with to").split()


def training_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Return a deterministic text corpus of arithmetic and task words for the BPE tokenizer."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
        corpus.append(f"{words} {a} {op} {b} = {value}. <answer>{value}</answer>")
    return corpus


def train_tokenizer(vocab_size: int, seed: int):
    """Return a byte-level BPE PreTrainedTokenizerFast with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(args, tokenizer):
    """Return the transformers config object for the requested architecture and sizes."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    common = dict(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, head_dim=head_dim,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=args.tie_word_embeddings, initializer_range=args.initializer_range,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|pad|>"),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
    )
    if args.arch == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if args.arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if args.arch == "qwen3_moe":
        # every layer sparse (no dense mlp_only_layers), as in Qwen3-30B-A3B
        return Qwen3MoeConfig(attention_bias=False, use_sliding_window=False, num_experts=args.num_experts,
                              num_experts_per_tok=args.num_experts_per_tok,
                              moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, **common)
    return Qwen3Config(attention_bias=False, use_sliding_window=False, **common)


@torch.no_grad()
def randomise_norms_and_biases(model, generator: torch.Generator) -> None:
    """Give norm weights and biases non-trivial values so that mapping mistakes show in the logits."""
    for name, param in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            base = 0.0 if name.endswith("bias") else 1.0
            param.copy_(base + 0.2 * noise)


def make_tiny_model(args) -> str:
    """Write the model and tokenizer to args.out and return the directory."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils.logging import disable_progress_bar

    tokenizer = train_tokenizer(args.vocab_size, args.seed)
    if len(tokenizer) > args.vocab_size:
        raise SystemExit(f"--vocab-size {args.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = hf_config(args, tokenizer)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise_norms_and_biases(model, torch.Generator().manual_seed(args.seed + 1))
    model = model.to(getattr(torch, args.dtype))
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                               bos_token_id=config.bos_token_id)
    os.makedirs(args.out, exist_ok=True)
    disable_progress_bar()  # one model file: its bar would be the only line of this step
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    return args.out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "qwen3_moe"), default="llama",
                   help="HF architecture family.")
    p.add_argument("--out", required=True, help="Output directory (save_pretrained layout).")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-key-value-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="Default: hidden size / attention heads.")
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe: routed experts per layer.")
    p.add_argument("--num-experts-per-tok", type=int, default=2, help="qwen3_moe: router top-k.")
    p.add_argument("--moe-intermediate-size", type=int, default=128, help="qwen3_moe: each expert's FFN size.")
    p.add_argument("--vocab-size", type=int, default=512, help="Model vocabulary (>= tokenizer size).")
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--initializer-range", type=float, default=0.02)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="Storage dtype of the saved weights.")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.arch == "qwen2" and args.head_dim not in (None, args.hidden_size // args.num_attention_heads):
        parser.error(f"--head-dim {args.head_dim} with --arch qwen2: vLLM's Qwen2 takes hidden size / attention "
                     "heads; use --arch qwen3")
    out = make_tiny_model(args)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    print(f"wrote {args.arch} model to {out}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, vocab {cfg['vocab_size']}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
