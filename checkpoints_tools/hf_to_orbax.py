"""Convert a Hugging Face Llama/Mistral/Qwen2 directory to an ouroboros-jax Orbax checkpoint.

    python -m checkpoints_tools.hf_to_orbax HF_DIR OUT_DIR [--dtype bfloat16]
"""

import argparse

from ouroboros_jax.models.loading import load_model
from ouroboros_jax.models.orbax_io import save_orbax


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("hf_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    model = load_model(a.hf_dir, dtype=a.dtype)
    save_orbax(a.out_dir, model)
    print(f"wrote {a.out_dir} ({model.config.num_params():,} params, {a.dtype})")


if __name__ == "__main__":
    main()
