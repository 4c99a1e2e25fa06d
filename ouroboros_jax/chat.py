"""Chat prompts: a list of messages -> the token ids an instruct model expects.

A conversation is a list of `{"role": str, "content": str}` dicts. It is rendered with the
tokenizer's own chat template and the generation prompt appended (the assistant turn's
opening), exactly as transformers' `apply_chat_template(add_generation_prompt=True)` does, so
the model continues as the assistant.

`end_of_turn_id` finds the token an instruct model ends its turn with: the first special token
its template writes after an assistant message's content (`<|im_end|>` for ChatML models such
as SmolLM2, Qwen2 and Qwen3, `<|eot_id|>` for Llama 3.x, `<|end|>` for Phi-3 / Phi-4-mini,
`<end_of_turn>` for Gemma, `</s>` for Llama 2 / Mistral). `load_model`
adds it to the default stop tokens, so a chat reply stops where the model ends its turn.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def is_conversation(p: Any) -> bool:
    """Whether `p` looks like one conversation: a non-empty list/tuple of dicts."""
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, dict) for m in p)


def check_messages(messages: Sequence[dict], where: str = "messages") -> list[dict]:
    """Validates a conversation; ValueError naming the message and the problem."""
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} "
                         f"messages, got {messages!r}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{j}] must be a dict with 'role' and 'content', got "
                             f"{type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"{where}[{j}] lacks {key!r} (a chat message is "
                                 "{'role': 'user', 'content': 'text'})")
        if not isinstance(m["role"], str) or not m["role"]:
            raise ValueError(f"{where}[{j}]['role'] must be a non-empty string such as 'user', "
                             f"got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}[{j}]['content'] must be a string, got "
                             f"{type(m['content']).__name__}")
        out.append(dict(m))
    return out


def chat_template_of(tokenizer) -> Optional[str]:
    if tokenizer is None:
        return None
    t = getattr(tokenizer, "chat_template", None)
    return t or None


def apply_chat(tokenizer, messages: Sequence[dict], where: str = "messages") -> list[int]:
    """Token ids of the rendered conversation with the generation prompt (no other special
    tokens added, as transformers does). ValueError when the tokenizer has no chat template."""
    messages = check_messages(messages, where)
    if tokenizer is None:
        raise ValueError(f"{where} is a chat conversation but the model has no tokenizer; pass "
                         "token-id lists instead")
    if chat_template_of(tokenizer) is None:
        raise ValueError(f"{where} is a chat conversation but the model's tokenizer has no chat "
                         "template (a base model, not an instruct one); pass the prompt as text "
                         "or token ids instead")
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja raises its own errors, e.g. templates refusing a role order
        raise ValueError(f"{where}: the chat template refused these messages "
                         f"({type(e).__name__}: {e})") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def end_of_turn_id(tokenizer) -> Optional[int]:
    """The special token the chat template writes right after an assistant message's content,
    or None (no template, or no special token there)."""
    if chat_template_of(tokenizer) is None:
        return None
    marker = "ouroboros-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False)
    except Exception:  # templates that refuse this conversation: no end-of-turn to learn
        return None
    if not isinstance(text, str) or marker not in text:
        return None
    rest = text[text.index(marker) + len(marker):].lstrip(" \n")
    special = getattr(tokenizer, "all_special_tokens", []) or []
    added = list(getattr(tokenizer, "get_added_vocab", lambda: {})().keys())
    for tok in sorted(set(special) | set(added), key=len, reverse=True):
        if tok and rest.startswith(tok):
            tid = tokenizer.convert_tokens_to_ids(tok)
            return int(tid) if isinstance(tid, int) and tid >= 0 else None
    return None
