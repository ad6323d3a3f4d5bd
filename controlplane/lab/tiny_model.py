"""Builds the tiny random-weight Llama model that the lab's vLLM engine serves.

Runs with the vLLM virtual environment's Python (torch, tokenizers and transformers come from
there), as `python tiny_model.py OUT_DIR`; it imports nothing from the rest of the project. No
model can be downloaded here, so the model is made locally: a byte-level BPE tokenizer (vocab
512) trained on generated text and wrapped in `PreTrainedTokenizerFast` with a chat template, and
a `LlamaForCausalLM` with head_dim 64 (the CPU attention backend rejects smaller heads). The
build is deterministic. The file `.complete` is written last and holds the SHA-256 of this
script, so a changed recipe rebuilds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
MAX_LEN = 1024
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
STAMP = ".complete"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (
    "the a of to and in is that for on with as by at from it this be are was not or an which cache "
    "prefix token engine request decode prefill model pool fleet latency throughput batch block "
    "memory expert router scheduler speculative draft accept reject metric signal policy scale "
    "replica queue wait run stop length error time first output input prompt context window"
).split()


def recipe_hash() -> str:
    """SHA-256 of this script: the stamp that marks a model built by this exact recipe."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _corpus(seed: int, lines: int = 4000) -> Iterator[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 20))]
        # Random letter strings and numbers too, so that arbitrary text tokenizes compactly.
        words.append("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
        words.append(str(rng.randint(0, 10_000)))
        rng.shuffle(words)
        yield " ".join(words) + (".\n" if i % 3 else ", {\"key\": [1, 2, 3]}\n")


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_LEN,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build(out: Path, seed: int = 0) -> Path:
    """Write the tokenizer and the random-weight model to `out` (replacing it) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a half-written model is never picked up.
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = build_tokenizer(seed)
        tokenizer.save_pretrained(work)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=MAX_LEN,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="float32",
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(work, safe_serialization=True)
        (work / STAMP).write_text(recipe_hash() + "\n")
        work.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: `tiny_model.py OUT_DIR [--seed N]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory to create (replaced if present)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.out, args.seed)
    print(f"tiny model written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
