"""The README's main job runs end to end (few prompts, short generations)."""

import pytest

from ouroboros_jax.cli import main


def test_demo_runs_and_reports_exactness(capsys):
    from ouroboros_jax import demo
    from ouroboros_jax.demo_assets import demo_prompts

    said = {}
    run = demo.run_demo
    with pytest.MonkeyPatch.context() as mp:  # the CLI's demo, its summary kept for the checks
        mp.setattr(demo, "run_demo", lambda **kw: said.setdefault("summary", run(**kw)))
        main(["demo", "--num-prompts", "1", "--max-new-tokens", "12"])
    summary = said["summary"]
    out = capsys.readouterr().out
    assert "identical to vanilla: yes" in out
    assert "tokens/s" in out
    rows = [line.split() for line in out.splitlines()  # the table's rows (notes are indented)
            if not line.startswith(" ") and line.split()[:1] in (["vanilla"], ["speculative"], ["lookahead"], ["ouroboros"],
                                    ["prompt_lookup"])]
    assert [r[0] for r in rows] == ["vanilla", "speculative", "lookahead", "ouroboros",
                                    "prompt_lookup"]
    assert all(r[4] == "yes" for r in rows)  # each method's tokens equal vanilla's
    # what Ouroboros ran of its own (free drafts, phrases, lengthening, ...) is said in a note
    ours = summary["methods"]["ouroboros"]
    said_own = [x for x in out.splitlines()
                if x.startswith("  ouroboros ran with its own mechanisms: ")]
    assert len(said_own) == ((ours["auto"] or {}).get("method") == "ouroboros")
    assert not said_own or said_own[0].endswith(", ".join(ours["mechanisms_on"])
                                                or "none (its SD step)")
    # every speculative row says what config=auto chose (a config, or off)
    assert all(("Config(" in " ".join(r[5:])) or r[5:6] == ["off:"] for r in rows[1:])
    # the prompt is printed, then its completion, before the table
    prompt = demo_prompts()[0]["text"].rstrip()
    at_prompt = out.index(f"--- prompt 1 ---\n{prompt}\n")
    assert at_prompt < out.index("--- completion", at_prompt) < out.index("tokens/s")
    # the fastest is named with what it ran, and each thing auto turned off is explained
    fastest = summary["fastest"]
    auto = summary["methods"][fastest]["auto"] or {}
    line = next(x for x in out.splitlines() if x.startswith("fastest here: "))
    # a method auto ran as vanilla is never named fastest: it ran vanilla's loop
    assert fastest == "vanilla" or auto.get("method") != "vanilla"
    ran = [m for m, r in summary["methods"].items()
           if m == "vanilla" or (r["auto"] or {}).get("method") != "vanilla"]
    assert summary["methods"][fastest]["tokens_per_second"] == max(
        summary["methods"][m]["tokens_per_second"] for m in ran)
    # Ouroboros' SD step, run as its own loop or as speculative's (`choice.as_run`)
    sd_as_speculative = fastest == "ouroboros" and auto.get("method") == "speculative"
    if "phrase_drafting=False" in (auto.get("config") or "") or sd_as_speculative:
        free = "free_drafts=True" in (auto.get("config") or "")
        assert (line.startswith("fastest here: ouroboros (free drafts at matches of ") if free
                else line.startswith("fastest here: ouroboros (as speculative γ")) \
            or "off)" in line
    else:
        assert line.startswith(f"fastest here: {fastest};")
    lines = out.splitlines()
    for m, r in summary["methods"].items():
        a = r["auto"] or {}
        if a.get("method") == "vanilla" and m != "vanilla":
            assert f"  {m}: {a['reason'].split(' (a priori')[0]}" in lines
        elif "=False" in (a.get("config") or "") or (
                m == "ouroboros" and a.get("method") == "speculative"):
            assert any(x.startswith(f"  {m}: auto turned off ") for x in lines)
        else:
            assert not any(x.startswith(f"  {m}: ") for x in lines)


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


# ------------------------------------------------------------------- the demo says the truth
OU_SD = ("OuroborosConfig(gamma=1, window=2, ngram=3, guesses=2, suffixes=1, "
         "phrase_drafting=False, lengthening=False, recycling=False, context_phrases=False)")


def test_fastest_label_names_only_the_mechanisms_that_ran():
    from ouroboros_jax.demo import describe_run

    label, why = describe_run("ouroboros", {"asked": "ouroboros", "method": "ouroboros",
                                            "config": OU_SD, "reason": "predicted 1.20x vanilla"})
    assert label == "ouroboros (as speculative γ1: mechanisms off on this device)"
    # one line naming every switch auto turned off, and auto's own reason
    assert "\n" not in why and "phrase_drafting, lengthening, recycling, context_phrases" in why
    assert "predicted 1.20x vanilla" in why
    # a partial ablation is named as such, not as speculative decoding
    label, why = describe_run("ouroboros", {"method": "ouroboros", "reason": "predicted 1.1x",
                                            "config": OU_SD.replace("phrase_drafting=False",
                                                                    "phrase_drafting=True")})
    assert label == "ouroboros (lengthening, recycling, context_phrases off)" and why
    # every mechanism on: the bare name, nothing to explain
    on = "OuroborosConfig(gamma=12, window=20, ngram=7, guesses=20, suffixes=3)"
    assert describe_run("ouroboros", {"method": "ouroboros", "config": on,
                                      "reason": "predicted 2.0x vanilla"}) == ("ouroboros", None)
    assert describe_run("vanilla", None) == ("vanilla", None)
    # the SD step run as speculative's loop (`choice.as_run`) is named as such, with the reason
    label, why = describe_run("ouroboros", {"method": "speculative", "reason": "predicted 1.3x",
                                            "config": "SpeculativeConfig(gamma=6)"})
    assert label == "ouroboros (as speculative γ6: mechanisms off on this device)"
    assert "predicted 1.3x" in why and "speculative's loop" in why
    # free drafts are named: over the SD step, beside other switches, alone
    sd_free = OU_SD.replace(")", ", free_drafts=True, free_threshold=3)")
    label, _ = describe_run("ouroboros", {"method": "ouroboros", "config": sd_free,
                                          "reason": "predicted 1.3x vanilla"})
    assert label == ("ouroboros (free drafts at matches of 3+ tokens, else speculative γ1: its "
                     "other mechanisms off on this device)")
    assert describe_run("ouroboros", {"method": "ouroboros", "reason": "x",
                                      "config": on.replace(")", ", free_drafts=True)")}
                        ) == ("ouroboros (free drafts on)", None)
    from ouroboros_jax.demo import mechanisms_on

    assert mechanisms_on(sd_free) == ["free drafts"]
    assert mechanisms_on(OU_SD) == []
    assert mechanisms_on(on) == ["phrase drafting", "lengthening", "recycling", "context phrases"]


def test_a_method_auto_ran_as_vanilla_says_so_and_why():
    from ouroboros_jax.demo import describe_run

    reason = ("no lookahead setting is predicted to beat vanilla here (best 0.97x): "
              "speculation is off for this call")
    label, why = describe_run("lookahead", {"asked": "lookahead", "method": "vanilla",
                                            "config": None, "reason": reason})
    assert label == "lookahead (ran vanilla)"
    assert why == f"lookahead: {reason}"


# ------------------------------------------------------------------- a quiet first contact
def _stderr_without_torch(code: str) -> str:
    """stderr of `code` run in a fresh interpreter where torch cannot be imported (the
    quick-start install has no torch; this environment has it for the peers)."""
    import os
    import subprocess
    import sys

    hide = "import sys; sys.modules['torch'] = None\n"  # find_spec('torch') -> None
    # transformers' own defaults (the suite's conftest quiets it with TRANSFORMERS_VERBOSITY)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS")}
    r = subprocess.run([sys.executable, "-c", hide + code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_no_pytorch_banner_after_importing_the_library():
    from ouroboros_jax.notices import TORCH_ADVISORY

    # transformers prints the banner when imported without torch...
    assert TORCH_ADVISORY in _stderr_without_torch("import transformers")
    # ...but not once ouroboros_jax is imported, and its other warnings still pass
    err = _stderr_without_torch(
        "import ouroboros_jax, transformers, logging\n"
        "logging.getLogger('transformers').warning('a real warning')\n"
        "ouroboros_jax.demo_pair()  # loads the tokenizer through transformers\n")
    assert TORCH_ADVISORY not in err
    assert "a real warning" in err
