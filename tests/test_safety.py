"""Safety properties of the package: configs cannot run code, remote code is opt-in, weights
are safetensors, checkpoints are read without unpickling code, no shell is ever involved."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from longctx_cli.config.load import config_from_dict, load_config
from longctx_cli.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1] / "longctx_cli"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    """Every call of `<something>.name(...)` or `name(...)` in the package."""
    found = []
    for source in SOURCES:
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    found.append((source, node))
    return found


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_python_object_tags_are_rejected(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(
        "sequence_len: !!python/object/apply:os.system\n"
        f"  - touch {marker}\n"
        "datasets: [{type: passkey}]\n"
    )
    with pytest.raises(UserError) as err:
        load_config(path)
    assert "invalid YAML" in str(err.value) and "python/object" in str(err.value)
    assert not marker.exists()


def test_yaml_is_only_ever_safe_loaded():
    for name in ("load", "load_all", "unsafe_load", "full_load", "full_load_all"):
        for source, call in _calls(name):
            func = call.func
            is_yaml = isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "yaml"
            assert not is_yaml, f"{source}:{call.lineno}: yaml.{name}; use yaml.safe_load"


def test_remote_code_is_off_unless_set():
    base = {"model_config": {"model_type": "llama"}, "datasets": [{"type": "passkey"}]}
    assert config_from_dict(base).model.trust_remote_code is False
    assert config_from_dict({**base, "trust_remote_code": True}).model.trust_remote_code is True
    # No from_pretrained turns it on by itself: the value always comes from the config.
    for source, call in _calls("from_pretrained"):
        value = _keyword(call, "trust_remote_code")
        assert not isinstance(value, ast.Constant) or value.value is False, (
            f"{source}:{call.lineno}"
        )


def test_remote_code_warns_when_set():
    from longctx_cli.runtime.model import load_base_model

    tiny = {
        "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 384,
    }
    config = config_from_dict({
        "model_config": tiny, "datasets": [{"type": "passkey"}], "trust_remote_code": True,
    })
    with pytest.warns(UserWarning, match="trust_remote_code"):
        load_base_model(config, "sdpa")


def test_weights_are_written_as_safetensors():
    saves = _calls("save_pretrained")
    assert saves
    for source, call in saves:
        safe = _keyword(call, "safe_serialization")
        # transformers writes safetensors by default; never ask it for pickles.
        assert safe is None or (isinstance(safe, ast.Constant) and safe.value is True), (
            f"{source}:{call.lineno}"
        )


def test_every_torch_load_is_weights_only():
    loads = [(s, c) for s, c in _calls("load") if ast.unparse(c.func) == "torch.load"]
    assert loads  # the scheduler and RNG states of a checkpoint are read with torch.load
    for source, call in loads:
        value = _keyword(call, "weights_only")
        assert isinstance(value, ast.Constant) and value.value is True, f"{source}:{call.lineno}"


def test_no_subprocess_goes_through_a_shell():
    for source in SOURCES:
        text = source.read_text()
        assert "os.system(" not in text and "os.popen(" not in text, source
    for name in ("run", "Popen", "call", "check_call", "check_output"):
        for source, call in _calls(name):
            func = call.func
            if not (isinstance(func, ast.Attribute) and ast.unparse(func.value) == "subprocess"):
                continue
            shell = _keyword(call, "shell")
            assert shell is None or (isinstance(shell, ast.Constant) and shell.value is False), (
                f"{source}:{call.lineno}: shell=True"
            )
            command = call.args[0] if call.args else _keyword(call, "args")
            # A list (or a name bound to one), never a string the shell would split.
            assert not isinstance(command, (ast.Constant, ast.JoinedStr, ast.BinOp)), (
                f"{source}:{call.lineno}: command given as a string"
            )
