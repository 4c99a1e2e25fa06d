"""The README's main job runs end to end (few prompts, short generations)."""

from ouroboros_jax.cli import main


def test_demo_runs_and_reports_exactness(capsys):
    main(["demo", "--num-prompts", "1", "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    assert "identical to vanilla: yes" in out
    assert "tokens/s" in out
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] in (["vanilla"], ["speculative"], ["lookahead"], ["ouroboros"],
                                    ["prompt_lookup"])]
    assert [r[0] for r in rows] == ["vanilla", "speculative", "lookahead", "ouroboros",
                                    "prompt_lookup"]
    assert all(r[4] == "yes" for r in rows)  # each method's tokens equal vanilla's
    # every speculative row says what config=auto chose (a config, or off)
    assert all(("Config(" in " ".join(r[5:])) or r[5:6] == ["off:"] for r in rows[1:])


def test_memory_command_prints_per_device_bytes(capsys):
    main(["memory", "--mesh", "1x8", "--preset", "llama-2-70b"])
    out = capsys.readouterr().out
    # Llama-2-70B has 68,976,648,192 parameters (its published safetensors index); in bf16,
    # with every matrix divisible 8 ways (64 q heads, 8 kv heads, FFN 28672, vocab 32000),
    # a device holds an eighth of them (norms are replicated but negligible).
    per_device_gib = 68_976_648_192 * 2 / 8 / 2**30
    assert "llama-2-70b" in out and "69.0B" in out and f"{per_device_gib:.2f}GiB" in out


def test_generate_command_with_method_config(tiny_pair, capsys):
    target, draft, _ = tiny_pair
    # the tiny models have no tokenizer, so text prompts are refused with the reason
    import pytest

    with pytest.raises(SystemExit, match="has no tokenizer"):
        main(["generate", "--target", target.path, "--draft", draft.path, "--prompt", "hi",
              "--method", "speculative", "--config", '{"gamma": 3}'])
    with pytest.raises(SystemExit, match="unexpected keyword argument 'gama'"):
        main(["generate", "--target", target.path, "--draft", draft.path, "--prompt", "hi",
              "--method", "speculative", "--config", '{"gama": 3}'])
