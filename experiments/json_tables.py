"""The workload's tables over the real pair's tokenizer (Qwen2.5, 151,936 ids) without loading
the model: states, classes, MiB, first build and cached read per schema, forced states.

    python -m experiments.json_tables
"""
import os, time, sys, json
from transformers import AutoTokenizer
from experiments.json_extract import TASKS, fmt
from ouroboros_jax.constrain import table_for
p = os.path.expanduser("~/.cache/ouroboros-real/qwen2.5-coder-1.5b-instruct-q4_k.gguf")
tok = AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))
V = 151936
eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
out = []
for text, schema in TASKS:
    t0 = time.perf_counter(); t = table_for(fmt(schema), tok, V, eos); b = time.perf_counter() - t0
    t0 = time.perf_counter(); table_for(fmt(schema), tok, V, eos); c = time.perf_counter() - t0
    out.append(dict(states=t.next_state.shape[0], classes=t.next_state.shape[1], mib=round(t.nbytes/2**20, 2), build_s=round(b, 2), cached_s=round(c, 4), forced_states=int((t.n_allowed == 1).sum())))
    print(json.dumps(out[-1]), flush=True)
