"""The files of a Hugging Face model directory that are not weights (tokenizer, chat template, generation config):
they travel with a checkpoint, an exported HF directory and an engine's model directory."""
from __future__ import annotations

import os
import shutil

from megatron_ais.errors import ArgumentValidationError

HF_ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def copy_hf_assets(src_dir: str, dst_dir: str) -> None:
    """Copy the non-weight files of a HF model directory (tokenizer, chat template, generation config)."""
    if not os.path.isdir(src_dir):  # copying nothing would leave a checkpoint or an export without its tokenizer
        raise FileNotFoundError(f"the HF assets directory {src_dir} is gone: nothing to copy the tokenizer from")
    os.makedirs(dst_dir, exist_ok=True)
    for name in HF_ASSET_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst_dir, name))


def load_tokenizer(path: str):
    """Return the HF tokenizer stored in a model directory or a checkpoint's hf_assets."""
    from transformers import AutoTokenizer  # heavy (seconds): imported where a tokenizer is loaded, not at --help

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:  # the rollouts' stop token and the SFT responses' last token
        raise ArgumentValidationError(f"the tokenizer in {path} has no end-of-sequence token (eos_token), so no "
                                      "response could end: give a model directory whose tokenizer defines one")
    return tokenizer
