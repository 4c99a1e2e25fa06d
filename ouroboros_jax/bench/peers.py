"""The transformers peers: transformers' own `generate` with torch on CPU, in fp32, on the
very same weights as ours (HF directories or GGUF files): greedy, assisted generation (the
draft as `assistant_model`) and prompt lookup decoding."""

from __future__ import annotations

import os
import time

HF_PEERS = {"hf-greedy": {}, "hf-assisted": {"assistant": True},
            "hf-pld": {"prompt_lookup_num_tokens": 10}}


class HFModels:
    """torch copies of the target/draft, loaded once per bench from the same checkpoints (HF
    directories or GGUF files), on first use: the peers run after every method of ours, whose
    packed copies are dropped first, so a 1.5B/0.5B fp32 pair's four copies (ours, packed,
    torch's) never sit in memory at once (measured: 20 GB peak, then refused, on 24 GB)."""

    def __init__(self, target, draft):
        if target.path is None:
            raise FileNotFoundError("the target was not loaded from a directory or GGUF file "
                                    "(no .path); transformers peers need the checkpoint")
        import torch  # noqa: F401  (a peer without torch is skipped before anything runs)
        import transformers  # noqa: F401

        self._paths = (target.path, draft.path if draft is not None else None)
        self._ours = (target, draft)
        self._loaded = None

    @property
    def has_draft(self) -> bool:
        return self._paths[1] is not None

    def _load(self):
        if self._loaded is None:
            import gc

            import jax

            from ..models import layout

            for m in self._ours:
                if m is not None:
                    layout.release(m)
            gc.collect()
            jax.clear_caches()
            t, d = self._paths
            self._loaded = (hf_load(t), hf_load(d) if d else None)
        return self._loaded

    @property
    def target(self):
        return self._load()[0]

    @property
    def draft(self):
        return self._load()[1]


def hf_load(path: str):
    """transformers' fp32 copy of the checkpoint at `path`: an HF directory, or a GGUF file
    (transformers dequantizes it itself, `gguf_file=`), so the peers run the same weights."""
    import torch
    import transformers

    from ..models.gguf import is_gguf_path

    if is_gguf_path(path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
            dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_caller(run, hf: HFModels, eos):
    """(call, shape_key) of a peer run (a `MethodRun` of kind "hf"), called as the runner calls
    ours: call(ids, n, pool) -> (tokens, seconds, stats, pool)."""
    import torch

    extra = dict(HF_PEERS[run.method])
    if extra.pop("assistant", False):
        if hf.draft is None:
            raise FileNotFoundError("assisted generation needs the draft's HF directory")
        extra["assistant_model"] = hf.draft

    def call(ids, n, pool):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=n, eos_token_id=None if eos == -1 else eos,
                                     pad_token_id=0, **extra)
        s = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        return toks, s, {"new_tokens": len(toks)}, None

    return call, lambda ids, n: (len(ids), n)
