"""The CLI's persistent compilation cache (`compile_cache`): where it goes, how it is turned
off, and that a directory JAX already has is kept."""

import jax
import pytest

from ouroboros_jax import compile_cache
from ouroboros_jax.cli import main


def test_the_flag_then_the_environment_then_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve(None) == str(tmp_path / "xdg" / "ouroboros-jax" / "xla")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve(None) == str(tmp_path / "env")
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert compile_cache.resolve("off") is None
    assert compile_cache.resolve("OFF") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve(None) is None


def test_a_directory_jax_already_has_wins(tmp_path):
    current = jax.config.jax_compilation_cache_dir  # the suite's own (conftest)
    assert current
    assert compile_cache.enable(str(tmp_path / "mine")) == current
    assert jax.config.jax_compilation_cache_dir == current
    assert not (tmp_path / "mine").exists()


def test_enable_sets_the_directory_and_a_bad_one_names_the_flag(monkeypatch, tmp_path):
    current = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises(ValueError, match="--compile-cache"):
            compile_cache.enable(str(blocker / "sub"))
        assert compile_cache.enable("off") is None
        assert not jax.config.jax_compilation_cache_dir
        path = compile_cache.enable(str(tmp_path / "c"))
        assert path == str(tmp_path / "c") and (tmp_path / "c").is_dir()
        assert jax.config.jax_compilation_cache_dir == path
    finally:
        jax.config.update("jax_compilation_cache_dir", current)


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_both_commands_take_the_flag(cmd, capsys):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    assert "--compile-cache" in capsys.readouterr().out
