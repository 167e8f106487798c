"""`autodeploy run`: argument errors and the embedded demo model (built offline). Generation through the
whole pipeline is covered by tests/e2e/test_generate_hf.py."""

from autodeploy.cli import main
from autodeploy.models.demo import DEMO_NAME, demo_model_path


def test_run_argument_errors(capsys, tmp_path):
    assert main(["run", "--model", str(tmp_path), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids '1,x'" in capsys.readouterr().err
    assert main(["run", "--model", str(tmp_path)]) == 2
    assert "no prompt given" in capsys.readouterr().err
    assert main(["run", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err

def test_demo_model_is_built_offline_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = demo_model_path()
    assert path == tmp_path / "autodeploy" / DEMO_NAME
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    mtime = (path / "config.json").stat().st_mtime
    assert demo_model_path() == path and (path / "config.json").stat().st_mtime == mtime  # cached
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Hello, world!\n")["input_ids"]
    assert tok.decode(ids) == "Hello, world!\n" and tok.eos_token_id == 1

def test_run_invalid_temperature(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["run", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
