"""Build a tiny random-weight Llama checkpoint that real vLLM can serve on CPU.

Run by ``manage.py make_tiny_model DIR`` with the vLLM venv's interpreter
(``.vllm/bin/python``): it needs torch, transformers and tokenizers, which the
platform itself does not depend on, and imports nothing from the platform.

What it writes into DIR, offline, the same bytes for the same seed and library
versions (``../shared/research/vllm-cpu.md``, section 2):

- ``tokenizer.json``, ``tokenizer_config.json``: a byte-level BPE of ``vocab_size``
  tokens trained with ``tokenizers`` on the first ``corpus_files`` ``*.py`` files of
  this interpreter's standard library (sorted by name; CPython 3.11.7 has 168), with the chat markers
  ``<|system|> <|user|> <|assistant|> <|end|>`` as special tokens;
- ``chat_template.jinja``: ``<|role|>\\ncontent<|end|>\\n`` per message, then
  ``<|assistant|>\\n`` (the same shape as the stand-in tokenizer's template);
- ``config.json``, ``generation_config.json``, ``model.safetensors``: a 2-layer
  Llama, hidden 128, 4 heads of 32 (the CPU attention backend's smallest head
  size), 2 KV heads, context 2048, bfloat16, weights drawn from ``seed``.

The tree is built in a sibling temporary directory and renamed into place, so DIR
either holds a complete checkpoint or does not exist.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import sysconfig
import tempfile

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
MAX_MODEL_LEN = 2048


def build(out: str, *, seed: int, vocab_size: int, corpus_files: int) -> None:
    """Write the checkpoint into ``out`` (which must not exist yet)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:corpus_files]
    if not files:
        raise SystemExit(f"no *.py files under {stdlib} to train the tokenizer on")

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.train(
        files,
        BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            show_progress=False,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".tiny-model.", dir=parent)
    try:
        wrapped.save_pretrained(partial)
        config = LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=MAX_MODEL_LEN,
            tie_word_embeddings=False,
            bos_token_id=wrapped.bos_token_id,
            eos_token_id=wrapped.eos_token_id,
            pad_token_id=wrapped.pad_token_id,
            torch_dtype="bfloat16",
        )
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(partial, safe_serialization=True)
        os.chmod(partial, 0o755)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="Directory to create.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus-files", type=int, default=200)
    args = parser.parse_args(argv)
    if os.path.exists(args.out):
        raise SystemExit(f"{args.out} already exists")
    # Offline: nothing may be fetched from a hub, and one tokenizer-training
    # thread keeps the merges independent of scheduling.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["RAYON_NUM_THREADS"] = "1"
    build(
        args.out,
        seed=args.seed,
        vocab_size=args.vocab_size,
        corpus_files=args.corpus_files,
    )
    sys.stdout.write(f"{args.out}: {', '.join(sorted(os.listdir(args.out)))}\n")


if __name__ == "__main__":
    main()
