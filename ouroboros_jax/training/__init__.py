"""Training the shipped demo pair: corpus manifest, tokenizer, packing, the train loop, the pair
quality report and the export to Hugging Face layout. See README.md in this folder."""
