"""Convert an ouroboros-jax Orbax checkpoint back to a Hugging Face directory.

    python -m checkpoints_tools.orbax_to_hf ORBAX_DIR OUT_DIR [--dtype bfloat16]
"""

import argparse

from ouroboros_jax.models.loading import save_hf_checkpoint
from ouroboros_jax.models.orbax_io import load_orbax


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("orbax_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    model = load_orbax(a.orbax_dir)
    save_hf_checkpoint(a.out_dir, model.config, model.params, dtype=a.dtype,
                       tokenizer=model.tokenizer)
    print(f"wrote {a.out_dir}")


if __name__ == "__main__":
    main()
