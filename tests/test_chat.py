"""Chat prompts: a conversation is rendered with the tokenizer's chat template and the
generation prompt, as transformers' apply_chat_template(add_generation_prompt=True) does; bad
messages and models without a template are refused by name; a model with a template stops at
its end-of-turn token by default."""

import json
import os

import pytest

import ouroboros_jax as oj
from ouroboros_jax.chat import apply_chat, end_of_turn_id
from ouroboros_jax.demo_assets import DEMO_DIR
from ouroboros_jax.generate import default_eos_ids

from conftest import copy_dir

# a toy template whose turns end with "<pad>" (id 0 of the demo vocabulary, a special token)
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}<pad>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """The demo target with a chat template added to its tokenizer_config.json."""
    d = copy_dir(DEMO_DIR / "target", tmp_path_factory.mktemp("chat") / "target")
    p = os.path.join(d, "tokenizer_config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(p, "w") as f:
        json.dump(cfg, f)
    return oj.load_model(d)


@pytest.fixture(scope="module")
def plain():
    return oj.demo_pair()[0]


def test_chat_ids_are_transformers_apply_chat_template(templated):
    want = templated.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    assert apply_chat(templated.tokenizer, CHAT) == list(want)
    text = templated.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                   tokenize=False)
    assert text.endswith("<s>assistant: ")


def test_generate_takes_conversations(templated):
    ids = list(templated.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))
    by_ids = oj.generate(templated, [ids], max_new_tokens=8)
    assert oj.generate(templated, [CHAT], max_new_tokens=8).tokens == by_ids.tokens
    # one conversation on its own is one prompt
    assert oj.generate(templated, CHAT, max_new_tokens=8).tokens == by_ids.tokens


def test_end_of_turn_is_a_default_stop(templated, plain):
    assert end_of_turn_id(templated.tokenizer) == 0
    assert templated.generation_config["eos_token_id"] == (2, 0)
    assert default_eos_ids(templated) == (2, 0)
    # without a template nothing changes
    assert end_of_turn_id(plain.tokenizer) is None
    assert default_eos_ids(plain) == 2


def test_end_of_turn_of_a_chatml_model(smollm2):
    assert end_of_turn_id(smollm2.tokenizer) == smollm2.tokenizer.convert_tokens_to_ids(
        "<|im_end|>")


def test_model_without_template_is_refused(plain):
    with pytest.raises(ValueError, match=r"prompts\[0\] is a chat conversation but the model's "
                                         "tokenizer has no chat template"):
        oj.generate(plain, [CHAT], max_new_tokens=4)


@pytest.mark.parametrize("msg, match", [
    ({"content": "hi"}, r"prompts\[0\]\[0\] lacks 'role'"),
    ({"role": "user"}, r"prompts\[0\]\[0\] lacks 'content'"),
    ({"role": "", "content": "hi"}, r"prompts\[0\]\[0\]\['role'\] must be a non-empty string"),
    ({"role": "user", "content": 3}, r"prompts\[0\]\[0\]\['content'\] must be a string"),
])
def test_bad_messages_are_named(templated, msg, match):
    with pytest.raises(ValueError, match=match):
        oj.generate(templated, [[msg]], max_new_tokens=4)


def test_a_message_among_text_prompts_is_refused(templated):
    with pytest.raises(ValueError, match=r"prompts\[1\] is a chat message among other prompts"):
        oj.generate(templated, ["def f():", {"role": "user", "content": "x"}], max_new_tokens=4)


def test_chat_without_tokenizer_is_refused(tiny_target):
    with pytest.raises(ValueError, match="the model has no tokenizer"):
        oj.generate(tiny_target, [CHAT], max_new_tokens=4)


# ------------------------------------------------------------------ the CLI's generate
def test_cli_generate_without_target_uses_the_demo_pair(capsys):
    from ouroboros_jax.cli import main

    main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--method",
          "vanilla"])
    target = oj.demo_pair()[0]
    want = oj.generate(target, ["def add(a, b):"], max_new_tokens=6).texts[0]
    assert capsys.readouterr().out == want + "\n"


def test_cli_generate_chat(templated, capsys):
    from ouroboros_jax.cli import main

    main(["generate", "--target", templated.path, "--chat", "def add(a, b):",
          "--system", "be brief", "--max-new-tokens", "6"])
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    assert capsys.readouterr().out == oj.generate(templated, [chat], max_new_tokens=6).texts[0] + "\n"


def test_cli_generate_needs_a_prompt():
    from ouroboros_jax.cli import main

    with pytest.raises(SystemExit, match="give at least one --prompt TEXT or --chat MESSAGE"):
        main(["generate"])


def test_cli_generate_gguf_target(tmp_path):
    """--target takes a .gguf file: this one loads (its metadata and weights are read) and, as
    it carries no tokenizer, the text prompt is then refused by name."""
    from ouroboros_jax.cli import main

    from conftest import make_hf_model
    from test_gguf import write_gguf

    tm = make_hf_model(tmp_path / "hf", vocab=97, hidden=64, layers=1, heads=4, kv_heads=2,
                       inter=128, seed=9)
    path = write_gguf(tmp_path / "t.gguf", tm)
    with pytest.raises(SystemExit, match=r"prompts\[0\] is text but the target has no tokenizer"):
        main(["generate", "--target", path, "--prompt", "x", "--max-new-tokens", "4"])


def test_cli_generate_missing_gguf(tmp_path):
    from ouroboros_jax.cli import main

    with pytest.raises(SystemExit, match="--model: .*nope.gguf.*does not exist"):
        main(["generate", "--target", str(tmp_path / "nope.gguf"), "--prompt", "x"])
    # the draft's path too, before its scheme is resolved (which may build the CPU kernel)
    import ouroboros_jax.cli as cli

    def never(*a, **k):
        raise AssertionError("resolved the draft's scheme before checking its path")

    real = cli._draft_scheme
    cli._draft_scheme = never
    try:
        with pytest.raises(SystemExit, match="--draft: .*nope2.gguf.*does not exist"):
            (tmp_path / "there.gguf").write_bytes(b"")
            main(["generate", "--target", str(tmp_path / "there.gguf"), "--draft",
                  str(tmp_path / "nope2.gguf"), "--prompt", "x"])
    finally:
        cli._draft_scheme = real
