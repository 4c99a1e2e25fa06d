"""Convert a GGUF file (llama or qwen2 architecture) to a Hugging Face safetensors directory.

    python -m checkpoints_tools.gguf_to_hf MODEL.gguf OUT_DIR [--dtype float32|bfloat16]

The weights are dequantized (every type the `gguf` package can dequantize), q/k rows are
un-permuted to the Hugging Face layout, and config.json, model.safetensors and the tokenizer
(with its chat template) built from the file's metadata are written; transformers and
`oj.load_model` both load the result. Nothing is written when the file is refused.
"""

import argparse
import json
import os
import shutil
import tempfile

from ouroboros_jax.models.loading import load_model, save_hf_checkpoint


def convert(gguf_path: str, out_dir: str, dtype: str = "float32") -> None:
    """Writes out_dir from gguf_path; out_dir must not exist yet or be empty (it is written
    into a temporary directory first and moved into place, so a failure leaves nothing)."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"out_dir {out_dir!r} exists and is not an empty directory")
    model = load_model(gguf_path, dtype=dtype)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf_to_hf.", dir=parent)
    try:
        save_hf_checkpoint(tmp, model.config, model.params, tokenizer=model.tokenizer)
        if model.generation_config:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(model.generation_config, f, indent=2)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    try:
        convert(a.gguf, a.out_dir, a.dtype)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"gguf_to_hf: error: {e}")
    print(f"wrote {a.out_dir} ({a.dtype})")


if __name__ == "__main__":
    main()
