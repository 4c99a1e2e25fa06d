"""Command-line converters between Hugging Face directories and Orbax checkpoints."""
