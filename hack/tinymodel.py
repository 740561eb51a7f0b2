"""Write a tiny random-weight Llama checkpoint, its tokenizer, and PEFT LoRA adapters for it.

`hack/make-tiny-model DIR [--seed N] [--head-dim 16|64]` runs this module. Nothing is
downloaded: the tokenizer is a byte-level BPE trained here on a small built-in corpus, the
weights come from a seeded generator, and the adapters are written by `peft` itself. The
same seed gives byte-identical files (for the same versions of torch, transformers, peft and
tokenizers, whose version numbers are recorded in `config.json` and `adapter_config.json`).

`--head-dim 64` writes the same model family with a wider attention head (hidden 128, two
heads), for engines whose attention kernels refuse head size 16 (vLLM's CPU backend); the
default stays the 16-wide one every other test uses.

Layout:
    DIR/base/                 config.json, generation_config.json, model.safetensors,
                              tokenizer.json, tokenizer_config.json, chat_template.jinja
    DIR/adapters/<name>/      adapter_config.json, adapter_model.safetensors, README.md
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

# The served name of the base model; adapters record it as their base.
BASE_MODEL_NAME = "tiny-llama"
CONTEXT_LENGTH = 512
TOKENIZER_VOCAB_SIZE = 512

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)

# Renders `<s><|user|>\nhi\n<|assistant|>\n...`; `</s>` closes each assistant turn so a
# model fine-tuned on it would learn to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# A few lines per adapter theme, so that the vocabulary has whole words for all of them.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model answers every question with confidence and very little knowledge.",
    "Workers serve requests, stream tokens, and drain gracefully when they are told to stop.",
    "Kubernetes schedules pods onto nodes; the operator reconciles what it sees and wants.",
    "Hello! How can I help you today? Tell me about the weather, the news, or the time.",
    "SELECT name, email FROM users WHERE id = 42 ORDER BY name LIMIT 10;",
    "INSERT INTO orders (user_id, total) VALUES (7, 19.99);",
    "UPDATE products SET price = price * 1.1 WHERE category = 'books';",
    "SELECT count(*) FROM events GROUP BY day HAVING count(*) > 100;",
    "Roses are red, violets are blue, the river runs silver and the morning is new.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "The moon sings softly to the sleeping sea, and the stars keep time.",
    "Once upon a time, in a land of numbers 0 1 2 3 4 5 6 7 8 9, a story began.",
)


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter to write: its name, rank and the projections it adapts."""

    name: str
    rank: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class Shape:
    """The base model's dimensions; `head_dim` is hidden_size / num_attention_heads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int


# By head dimension: 16 is the default everywhere; 64 is the smallest vLLM's CPU attention takes.
SHAPES = {
    16: Shape(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    64: Shape(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2),
}
DEFAULT_HEAD_DIM = 16


# Different ranks and target modules, so serving them together exercises PEFT's mixing.
ADAPTERS = (
    AdapterSpec("sql-lora", 4, ("q_proj", "v_proj")),
    AdapterSpec("poet-lora", 8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    AdapterSpec("chat-lora", 4, ("gate_proj", "up_proj", "down_proj")),
)

# Standard deviation of the random weights. Larger than the usual 0.02 so that the random
# model's greedy output varies from token to token instead of repeating one token.
WEIGHT_STD = 0.3
LORA_STD = 0.5


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `CORPUS`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Llama-style: plain `encode` prepends <s>; the chat template writes it itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONTEXT_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def build_base_model(
    vocab_size: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    seed: int,
    shape: Shape = SHAPES[DEFAULT_HEAD_DIM],
) -> LlamaForCausalLM:
    """A 2-layer Llama of `shape` with random weights drawn from a generator seeded with `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=CONTEXT_LENGTH,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Named order is fixed by the architecture, so the draws are reproducible.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
    model.generation_config.pad_token_id = pad_id
    model.eval()
    return model


def build_adapter(base: LlamaForCausalLM, spec: AdapterSpec, seed: int) -> PeftModel:
    """A PEFT LoRA model over a copy of `base` with seeded, non-zero A and B matrices."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=2 * spec.rank,
        lora_dropout=0.0,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    # PEFT wraps the modules it adapts in place: work on a copy to keep `base` clean.
    with warnings.catch_warnings():
        # peft probes a deprecated transformers attribute; not ours to fix.
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
    saved = peft_model.peft_config["default"]
    assert isinstance(saved, LoraConfig)
    # The model has no hub name; record ours. PEFT keeps target modules in a set, which
    # would be written in hash order: a sorted list makes the file reproducible.
    saved.base_model_name_or_path = BASE_MODEL_NAME
    saved.target_modules = sorted(spec.target_modules)
    return peft_model


def _portable_tokenizer_class(config_path: Path) -> None:
    """Name the tokenizer class `PreTrainedTokenizerFast`, which every transformers version
    loads (v5 maps it to its `TokenizersBackend`; v4 has no class of that name)."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tiny_model(out_dir: Path, seed: int = 0, head_dim: int = DEFAULT_HEAD_DIM) -> list[Path]:
    """Write the base checkpoint (of `SHAPES[head_dim]`) and every adapter under `out_dir`;
    return the files written."""
    tokenizer = build_tokenizer()
    base_dir = out_dir / "base"
    vocab_size = len(tokenizer)
    ids = {tok: tokenizer.vocab[tok] for tok in (BOS, EOS, PAD)}
    model = build_base_model(vocab_size, ids[BOS], ids[EOS], ids[PAD], seed, SHAPES[head_dim])
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    _portable_tokenizer_class(base_dir / "tokenizer_config.json")
    for index, spec in enumerate(ADAPTERS, start=1):
        # Distinct streams per adapter, all derived from the one seed.
        adapter = build_adapter(model, spec, seed * 1000 + index)
        # No embedding layers are adapted; "auto" would look the base name up on the hub.
        adapter.save_pretrained(str(out_dir / "adapters" / spec.name), save_embedding_layers=False)
    return sorted(path for path in out_dir.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> int:
    """CLI: write the tiny model into DIR and print each file with its size."""
    parser = argparse.ArgumentParser(
        prog="make-tiny-model",
        description="Write a tiny random-weight Llama checkpoint (DIR/base, with tokenizer and "
        "chat template) and PEFT LoRA adapters for it (DIR/adapters/<name>), deterministic "
        "from the seed. Nothing is downloaded.",
    )
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--head-dim",
        type=int,
        choices=sorted(SHAPES),
        default=DEFAULT_HEAD_DIM,
        help=f"attention head size (default {DEFAULT_HEAD_DIM}; 64 for vLLM's CPU attention)",
    )
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    out_dir: Path = args.dir
    if out_dir.exists() and any(out_dir.iterdir()):
        parser.error(f"{out_dir} exists and is not empty; pass a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as transformers_logging

    # A one-shard save needs no progress bar on the terminal.
    transformers_logging.disable_progress_bar()
    for path in write_tiny_model(out_dir, args.seed, args.head_dim):
        print(f"{path.stat().st_size:>10}  {path}")
    names = ", ".join(spec.name for spec in ADAPTERS)
    print(f"base model: {out_dir / 'base'} (served name {BASE_MODEL_NAME}); adapters: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
