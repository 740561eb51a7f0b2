"""`hack/make-tiny-model`: layout, loadability, and byte-identical output for a seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from dynamo.common.lora.adapter import validate_path
from support.tiny_model import REPO, TINY_MODEL_SEED, TinyModel, load_generator

pytestmark = pytest.mark.unit


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_command_writes_the_same_bytes_for_the_same_seed(
    tiny_model: TinyModel, tmp_path: Path
) -> None:
    out = tmp_path / "model"
    # Another process, another hash seed: nothing may depend on set or dict hash order.
    env = {**os.environ, "DYNAMO_PYTHON": sys.executable, "PYTHONHASHSEED": "4242"}
    result = subprocess.run(
        [str(REPO / "hack" / "make-tiny-model"), str(out), "--seed", str(TINY_MODEL_SEED)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    written = _tree(out)
    assert written == _tree(tiny_model.root)
    # Every file is listed on stdout, with the base and adapter summary last.
    for relative in written:
        assert str(out / relative) in result.stdout
    assert "adapters: sql-lora, poet-lora, chat-lora" in result.stdout


def test_layout_is_a_loadable_llama_with_tokenizer_and_peft_adapters(
    tiny_model: TinyModel,
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model.base)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    assert config.max_position_embeddings == 512
    tokenizer = AutoTokenizer.from_pretrained(tiny_model.base)
    assert config.vocab_size == len(tokenizer)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<s>",
        "</s>",
        "<pad>",
    )
    assert config.eos_token_id == tokenizer.eos_token_id
    # Byte-level BPE: any text round-trips, and plain encoding prepends <s> like Llama.
    text = "SELECT name FROM users; roses are red. Ünïcode ✓"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s><|user|>\nhi\n<|assistant|>\n"

    assert set(tiny_model.adapters) == {"sql-lora", "poet-lora", "chat-lora"}
    for name, path in tiny_model.adapters.items():
        assert validate_path(path), name
        adapter_config = json.loads((path / "adapter_config.json").read_text())
        assert adapter_config["peft_type"] == "LORA"
        assert adapter_config["base_model_name_or_path"] == tiny_model.served_name
        tensors = load_file(path / "adapter_model.safetensors")
        b_matrices = [t for key, t in tensors.items() if "lora_B" in key]
        # PEFT initialises B to zero; ours are random so the adapter changes the output.
        assert b_matrices, name
        assert all(abs(t).sum() > 0 for t in b_matrices), name


def test_another_seed_changes_the_weights_but_not_the_tokenizer(
    tiny_model: TinyModel, tmp_path: Path
) -> None:
    load_generator().write_tiny_model(tmp_path, TINY_MODEL_SEED + 1)
    for relative in ("base/model.safetensors", "adapters/sql-lora/adapter_model.safetensors"):
        assert (tmp_path / relative).read_bytes() != (tiny_model.root / relative).read_bytes()
    for relative in ("base/tokenizer.json", "base/config.json"):
        assert (tmp_path / relative).read_bytes() == (tiny_model.root / relative).read_bytes()


def test_refuses_a_non_empty_directory_and_a_negative_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generator = load_generator()
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        generator.main([str(tmp_path)])
    assert exc.value.code == 2
    assert "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generator.main([str(tmp_path / "new"), "--seed", "-1"])
    assert "--seed must be >= 0" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"
