"""Byte-level BPE for Python source, trained on the corpus's training split.

Special tokens take the first ids: <pad>=0, <s>=1 (BOS), </s>=2 (EOS); the model configs use the
same ids. Encoding adds BOS in front (as Llama's tokenizer does) and no EOS. Saved as a
`PreTrainedTokenizerFast` directory (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) so `transformers.AutoTokenizer.from_pretrained(dir)` loads it.

    python -m ouroboros_jax.training.tokenizer --manifest runs/corpus/manifest.json --out runs/tokenizer
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ouroboros_jax.training import corpus

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_VOCAB = 8192


def train_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no UNK
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if hasattr(texts, "__len__") else None)
    assert [tok.token_to_id(t) for t in (PAD, BOS, EOS)] == [PAD_ID, BOS_ID, EOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 2048) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # byte-level BPE round-trips exactly; no space fixing
    )
    fast.save_pretrained(str(out_dir))


def load_tokenizer(dir_: str | Path) -> Tokenizer:
    """The raw `tokenizers` object (fast batch encoding for data preparation)."""
    return Tokenizer.from_file(str(Path(dir_) / "tokenizer.json"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default="runs/corpus/manifest.json")
    ap.add_argument("--out", default="runs/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    a = ap.parse_args(argv)
    texts = corpus.read_texts(corpus.load_manifest(a.manifest), "train")
    tok = train_tokenizer(texts, a.vocab_size)
    save_hf_tokenizer(tok, a.out)
    n = sum(len(e.ids) for e in tok.encode_batch(texts[:200]))
    b = sum(len(t.encode()) for t in texts[:200])
    print(f"{a.out}: vocab {tok.get_vocab_size()}, {b / n:.2f} bytes/token on the first 200 files")


if __name__ == "__main__":
    main()
